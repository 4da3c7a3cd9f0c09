//! One `encode` call as scheduler steps: plan the steps, map each step's rows to its adapters'
//! slots, run tower and connector once over the step, read the outputs back and split them per
//! request.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use burn::tensor::{Tensor, TensorData};
// `std::time::Instant` panics on wasm32 (no clock there); this one reads the page's.
use web_time::Instant;

use super::checks::{check_ids, request_patches};
use super::faults::{guarded, guarded_async};
use super::plan::{PlanItem, plan_steps};
use super::{Encoded, Engine, EngineError, HostTensor, Request};
use crate::models::VisionOutput;
use crate::ops::lora::LoraBatch;
use crate::preprocess::Patches;
use crate::routing::mapping::{
    AdapterRequest, EncoderCache, LoraState, MmFeature, MmLoraActivation, Modality,
    PlaceholderRange, SpatialMergeCounts, set_active_mm_loras,
};
use crate::routing::meta::KernelMeta;
use crate::runtime::progress;

impl Engine {
    /// Encodes `requests`, each with its own adapter, in as few steps as the limits allow, and
    /// returns one result per request in the same order. Everything is checked (ids, adapter
    /// names, images) before anything runs; with `with_tower` the tower's output comes back too.
    /// An adapter whose weights were evicted from memory (`max_cpu_adapters`) is read back from
    /// its folder at the step that needs it, and a folder that fails then fails the call, as
    /// does an output that is not finite ([`EngineError::NotFinite`]).
    ///
    /// Waits for the device: [`Engine::encode_async`] is the same call for code that must not
    /// block (a browser's).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode(
        &mut self,
        requests: &[Request],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        pollster::block_on(self.encode_async(requests, with_tower))
    }

    /// [`Engine::encode`], awaiting the device's results instead of waiting for them.
    pub async fn encode_async(
        &mut self,
        requests: &[Request],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        check_ids(requests)?;
        self.check_adapters(requests)?;
        let patches = requests
            .iter()
            .map(|request| {
                request_patches(
                    request,
                    &self.preprocess,
                    self.options.image_backend,
                    self.model.layout(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.encode_patches(requests, &patches, with_tower).await
    }

    /// Plans and runs the steps of requests whose patches are ready and checked.
    pub(super) async fn encode_patches(
        &mut self,
        requests: &[Request],
        patches: &[Patches],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        if let Some(reason) = &self.lost {
            return Err(EngineError::DeviceLost(reason.clone()));
        }
        let step_rows = self.step_rows();
        if let Some((request, patches)) = requests
            .iter()
            .zip(patches)
            .find(|(_, p)| p.rows() > step_rows)
        {
            return Err(EngineError::TooLarge {
                request: request.id.clone(),
                rows: patches.rows(),
                limit: step_rows,
            });
        }
        let mut tags: Vec<&str> = Vec::new();
        let items: Vec<PlanItem> = requests
            .iter()
            .zip(patches)
            .map(|(request, patches)| PlanItem {
                adapter: request.adapter.as_deref().map(|name| {
                    tags.iter().position(|&t| t == name).unwrap_or_else(|| {
                        tags.push(name);
                        tags.len() - 1
                    })
                }),
                rows: patches.rows(),
            })
            .collect();
        let steps = plan_steps(&items, self.options.max_loras, step_rows);

        let mut results: Vec<Option<Encoded>> = vec![None; requests.len()];
        for (step, members) in steps.iter().enumerate() {
            let outputs = self
                .run_step(step, members, requests, patches, with_tower)
                .await?;
            for (&i, output) in members.iter().zip(outputs) {
                results[i] = Some(output);
            }
            if steps.len() > 1 {
                progress::report("encoding steps", step as u64 + 1, steps.len() as u64);
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every request is planned in exactly one step"))
            .collect())
    }

    /// One scheduler step over `requests[members]`: the step's mappings, the forward pass on its
    /// adapters' slots, the outputs split per request.
    async fn run_step(
        &mut self,
        step: usize,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        let activation = self.schedule(members, requests, patches)?;
        let started = Instant::now();
        let grids: Vec<[usize; 3]> = members.iter().map(|&i| patches[i].grid_thw).collect();
        let pixels: Vec<f32> = members
            .iter()
            .flat_map(|&i| patches[i].pixel_values.iter().copied())
            .collect();
        let rows = pixels.len() / self.model.layout().patch_len();
        let outputs = self
            .run_keeping_slots(&activation, pixels, &grids, with_tower)
            .await?;
        let step_time = started.elapsed();
        tracing::debug!(
            step,
            requests = members.len(),
            adapters = activation.adapters.len(),
            rows,
            ms = step_time.as_secs_f64() * 1e3,
            "step encoded"
        );
        let outputs = StepOutputs {
            step,
            step_time,
            outputs,
        };
        self.split(outputs, members, requests, patches)
    }

    /// The step as vLLM's scheduler hands it to the model runner (one image item per request),
    /// through the mapping builder: the step's adapters and each row's adapter id.
    fn schedule(
        &mut self,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
    ) -> Result<MmLoraActivation, EngineError> {
        let keys = self.step_adapters(
            members
                .iter()
                .filter_map(|&i| requests[i].adapter.as_deref()),
        )?;
        let merge = self.model.layout().spatial_merge_size;
        let mut cache = EncoderCache::default();
        let mut state = LoraState::new(members.len());
        let mut batch_index = HashMap::new();
        let mut scheduled = Vec::with_capacity(members.len());
        for (index, &i) in members.iter().enumerate() {
            let request = &requests[i];
            cache.mm_features.insert(
                request.id.clone(),
                vec![MmFeature {
                    identifier: request.id.clone(),
                    modality: Modality::Image,
                    position: PlaceholderRange::new(0, patches[i].rows() / (merge * merge)),
                    has_data: true,
                }],
            );
            let adapter = request.adapter.as_ref().map(|name| AdapterRequest {
                name: name.clone(),
                id: keys[name],
                path: self
                    .registry
                    .registration(name)
                    .map(|r| r.dir.clone())
                    .unwrap_or_default(),
            });
            state.add_request(&request.id, index, adapter)?;
            batch_index.insert(request.id.clone(), index);
            scheduled.push((request.id.clone(), vec![0]));
        }
        let activation = set_active_mm_loras(
            &SpatialMergeCounts {
                merge: NonZeroUsize::new(merge).expect("the config refuses a merge size of 0"),
            },
            &cache,
            &batch_index,
            &state,
            &scheduled,
        )?;
        Ok(activation.expect("a step schedules at least one image"))
    }

    /// [`Self::run_on_slots`], except that a step that fails gives its slots back as they were,
    /// so that the next call does not stack this step's adapters again (and fail the same way).
    async fn run_keeping_slots(
        &mut self,
        activation: &MmLoraActivation,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        with_tower: bool,
    ) -> Result<HostOutputs, EngineError> {
        let before = (
            self.slots.clone(),
            self.slot_used.clone(),
            self.stacked.clone(),
        );
        let ran = self
            .run_on_slots(activation, pixels, grids, with_tower)
            .await;
        if ran.is_err() {
            let (slots, slot_used, stacked) = before;
            if self.stacked != stacked {
                self.stacked = None; // the model holds this step's stacks, or half of them
            }
            (self.slots, self.slot_used) = (slots, slot_used);
        }
        ran
    }

    /// The step's rows split per request; an output that is not finite fails the step, naming
    /// the request.
    fn split(
        &self,
        outputs: StepOutputs,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
    ) -> Result<Vec<Encoded>, EngineError> {
        let merge = self.model.layout().spatial_merge_size;
        let StepOutputs {
            step,
            step_time,
            outputs:
                HostOutputs {
                    embeds,
                    tower,
                    deepstack,
                },
        } = outputs;
        let mut start = 0;
        members
            .iter()
            .map(|&i| {
                let rows = patches[i].rows();
                let tower = tower.as_ref().map(|t| t.rows(start, rows));
                let merged = (start / (merge * merge), rows / (merge * merge));
                let embeds = embeds.rows(merged.0, merged.1);
                let deepstack = deepstack.as_ref().map(|d| d.rows(merged.0, merged.1));
                start += rows;
                let request = &requests[i].id;
                for (output, values) in [
                    ("embeddings", Some(&embeds)),
                    ("tower outputs", tower.as_ref()),
                    ("deepstack outputs", deepstack.as_ref()),
                ] {
                    if let Some((row, value)) = values.and_then(HostTensor::first_not_finite) {
                        return Err(EngineError::NotFinite {
                            request: request.clone(),
                            output,
                            value,
                            row,
                            precision: self.options.precision,
                        });
                    }
                }
                Ok(Encoded {
                    id: request.clone(),
                    adapter: requests[i].adapter.clone(),
                    grid_thw: patches[i].grid_thw,
                    embeds,
                    tower,
                    deepstack,
                    step,
                    step_time,
                })
            })
            .collect()
    }

    /// Puts the step's adapters in GPU slots, runs it ([`Self::launch_step`]) and reads its
    /// outputs back.
    async fn run_on_slots(
        &mut self,
        activation: &MmLoraActivation,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        with_tower: bool,
    ) -> Result<HostOutputs, EngineError> {
        let activated =
            self.activate(&activation.adapters.iter().map(|a| a.id).collect::<Vec<_>>());
        self.classify(activated)?;
        let tower_meta = KernelMeta::from_mapping(&activation.tower, &self.slots)?;
        let connector_meta = KernelMeta::from_mapping(
            activation
                .connector
                .as_ref()
                .expect("the spatial merger is a connector"),
            &self.slots,
        )?;
        let launched = guarded(|| self.launch_step(pixels, grids, tower_meta, connector_meta));
        let outcome = match launched {
            Ok(output) => guarded_async(read_outputs(output, with_tower)).await,
            Err(error) => Err(error),
        };
        self.classify(outcome)
    }

    /// Uploads a step's patches and runs tower and connector; the outputs stay on the device.
    fn launch_step(
        &self,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        tower_meta: KernelMeta,
        connector_meta: KernelMeta,
    ) -> Result<VisionOutput, EngineError> {
        let on = &self.device.device;
        let rows = pixels.len() / self.model.layout().patch_len();
        let pixels = Tensor::<2>::from_data(
            TensorData::new(pixels, [rows, self.model.layout().patch_len()]),
            on,
        );
        Ok(self.model.forward(
            pixels,
            grids,
            &LoraBatch::with_kernels(tower_meta, &self.device, self.model.kernels().lora),
            &LoraBatch::with_kernels(connector_meta, &self.device, self.model.kernels().lora),
        )?)
    }
}

/// Reads a step's outputs into host memory (the tower's only `with_tower`).
async fn read_outputs(output: VisionOutput, with_tower: bool) -> Result<HostOutputs, EngineError> {
    Ok(HostOutputs {
        embeds: read_back(output.embeds).await?,
        tower: match with_tower {
            true => Some(read_back(output.tower).await?),
            false => None,
        },
        deepstack: match output.deepstack {
            Some(deepstack) => Some(read_back(deepstack).await?),
            None => None,
        },
    })
}

/// Reads a device tensor into host memory once the device has computed it.
async fn read_back(tensor: Tensor<2>) -> Result<HostTensor, EngineError> {
    let shape = tensor.dims();
    let execution = |e: &dyn std::fmt::Display| EngineError::Execution(e.to_string());
    let values = tensor
        .into_data_async()
        .await
        .map_err(|e| execution(&e))?
        .try_into_vec_as::<f32>()
        .map_err(|e| execution(&e))?;
    Ok(HostTensor { shape, values })
}

/// A forward pass's outputs in host memory.
struct HostOutputs {
    embeds: HostTensor,
    tower: Option<HostTensor>,
    deepstack: Option<HostTensor>,
}

/// What one step's forward pass gave, before it is split per request.
struct StepOutputs {
    step: usize,
    step_time: Duration,
    outputs: HostOutputs,
}
