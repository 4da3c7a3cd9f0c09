//! The demo window: images, adapters, the batch table, and what a run did.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};

use eframe::egui::{
    self, Align2, Color32, ColorImage, FontId, Pos2, Rect, Sense, TextureHandle, TextureOptions,
    Vec2, ViewportCommand,
};
use egui_plot::{Line, Plot, PlotPoints, Points};
use mmlora::runtime::device::RuntimeDevice;

use crate::worker::{self, AdapterInfo, Compute, Job, Reply};
use mmlora::analysis::{self, BatchRow, Heat, RunResult};

/// Set when a screenshot run saw an error, so the process can exit with 1.
pub static SCREENSHOT_RUN_FAILED: AtomicBool = AtomicBool::new(false);

/// The bundled adapters and the preset batch (image, adapter) run at start: those of them the
/// model folder has (another model may have none).
const PRESET_ADAPTERS: [&str; 4] = ["all-r4", "rslora-r8", "tower-r2", "patterns"];
const PRESET_BATCH: [(&str, Option<&str>); 5] = [
    ("square.png", Some("all-r4")),
    ("square.png", Some("tower-r2")),
    ("wide.jpg", Some("rslora-r8")),
    ("progressive.jpg", Some("patterns")),
    ("lossless.webp", None),
];
/// The bundled tiny model of each family, under `assets/`: the model picker's choices.
const BUNDLED_MODELS: [&str; 3] = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"];
/// The largest side of the heatmap view, in points.
const HEATMAP_SIDE: f32 = 360.0;
/// The largest side of an image as the heatmap shows it, in pixels.
const PICTURE_SIDE: u32 = 768;

/// `--screenshot FILE --frames N`: after the preset run, N frames, a screenshot, exit.
pub struct ScreenshotPlan {
    file: PathBuf,
    frames: u32,
    rendered: u32,
    requested: bool,
    saved: Arc<Mutex<Option<Result<(), String>>>>,
}

impl ScreenshotPlan {
    /// A plan to save `file` after `frames` frames.
    pub fn new(file: PathBuf, frames: u32) -> Self {
        Self {
            file,
            frames,
            rendered: 0,
            requested: false,
            saved: Arc::new(Mutex::new(None)),
        }
    }
}

struct ImageEntry {
    path: PathBuf,
    picture: Picture,
}

/// An image as the heatmap shows it: decoded on a thread of its own when first shown.
enum Picture {
    NotLoaded,
    Loading,
    Ready(TextureHandle),
}

/// An image decoded and shrunk for the heatmap, or why it could not be.
type Decoded = (PathBuf, Result<ColorImage, String>);

/// The demo's state.
pub struct DemoApp {
    jobs: Sender<Job>,
    replies: Receiver<Reply>,
    decoder: Sender<Decoded>,
    decoded: Receiver<Decoded>,
    gpu: Option<String>,
    /// The device a new compute thread gets (the model picker starts one).
    device: Option<RuntimeDevice>,
    /// Wakes the window when the compute thread has news.
    ctx: egui::Context,
    /// The model folder the compute thread serves, and the others the picker offers.
    model_dir: PathBuf,
    models: Vec<PathBuf>,
    compute: Compute,
    images: Vec<ImageEntry>,
    adapters: Vec<AdapterInfo>,
    batch: Vec<BatchRow>,
    running: bool,
    progress: String,
    result: Option<RunResult>,
    selected: usize,
    /// Images per second of each finished run.
    history: Vec<[f64; 2]>,
    errors: Vec<String>,
    image_path: String,
    adapter_path: String,
    screenshot: Option<ScreenshotPlan>,
    /// Where the heatmap and the results table were drawn last (points), for screenshot checks.
    drawn: [Option<Rect>; 2],
}

impl DemoApp {
    /// Starts the compute thread, loads the bundled adapters and runs the preset batch (those
    /// of them that `model_dir` has).
    pub fn new(
        cc: &eframe::CreationContext<'_>,
        model_dir: PathBuf,
        gpu: Option<RuntimeDevice>,
        screenshot: Option<ScreenshotPlan>,
    ) -> Self {
        let ctx = cc.egui_ctx.clone();
        let (jobs, replies) = start_worker(&ctx, &model_dir, &gpu);
        let (decoder, decoded) = channel();
        let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
        let mut models: Vec<PathBuf> = BUNDLED_MODELS.iter().map(|m| assets.join(m)).collect();
        if !models.contains(&model_dir) {
            models.insert(0, model_dir.clone());
        }
        let mut app = Self {
            jobs,
            replies,
            decoder,
            decoded,
            device: gpu.clone(),
            ctx,
            model_dir,
            models,
            compute: if gpu.is_some() {
                Compute::Gpu
            } else {
                Compute::Cpu
            },
            gpu: gpu.map(|g| g.description),
            images: Vec::new(),
            adapters: Vec::new(),
            batch: Vec::new(),
            running: false,
            progress: String::new(),
            result: None,
            selected: 0,
            history: Vec::new(),
            errors: Vec::new(),
            image_path: String::new(),
            adapter_path: String::new(),
            screenshot,
            drawn: [None; 2],
        };
        app.open_model_folder();
        app
    }

    /// Switches to the model in `dir` (the picker): a new compute thread serving it (the old
    /// one ends with its queue), and the folder's images, adapters and preset batch in place of
    /// the old model's.
    fn switch_model(&mut self, dir: PathBuf) {
        (self.jobs, self.replies) = start_worker(&self.ctx, &dir, &self.device);
        self.model_dir = dir;
        self.images.clear();
        self.adapters.clear();
        self.batch.clear();
        self.result = None;
        self.running = false;
        self.progress.clear();
        self.selected = 0;
        self.history.clear();
        self.open_model_folder();
    }

    /// Loads the model folder's images and those of the bundled adapters it has, and runs the
    /// preset batch's rows it has.
    fn open_model_folder(&mut self) {
        let model_dir = self.model_dir.clone();
        let images = model_dir.join("images");
        for entry in std::fs::read_dir(&images).into_iter().flatten().flatten() {
            if entry.path().is_file() {
                self.add_image(entry.path());
            }
        }
        self.images.sort_by(|a, b| a.path.cmp(&b.path));
        let adapters: Vec<&str> = PRESET_ADAPTERS
            .into_iter()
            .filter(|name| is_adapter(&model_dir.join("adapters").join(name)))
            .collect();
        for name in &adapters {
            self.load_adapter(model_dir.join("adapters").join(name));
        }
        for (image, adapter) in PRESET_BATCH {
            let image = images.join(image);
            if image.is_file() && adapter.is_none_or(|a| adapters.contains(&a)) {
                self.batch.push(BatchRow {
                    image,
                    adapter: adapter.map(str::to_owned),
                });
            }
        }
        if !self.batch.is_empty() {
            self.run();
        }
    }

    fn add_image(&mut self, path: PathBuf) {
        if !self.images.iter().any(|i| i.path == path) {
            self.images.push(ImageEntry {
                path,
                picture: Picture::NotLoaded,
            });
        }
    }

    /// Asks the worker to load the PEFT folder `dir`, or says why it is not one.
    fn load_adapter(&mut self, dir: PathBuf) {
        if is_adapter(&dir) {
            let _ = self.jobs.send(Job::LoadAdapter {
                dir,
                on: self.compute,
            });
        } else {
            self.errors.push(format!(
                "{} is not a PEFT adapter folder: it has no adapter_config.json",
                dir.display()
            ));
        }
    }

    fn run(&mut self) {
        self.running = true;
        self.progress = "queued".to_owned();
        let _ = self.jobs.send(Job::Run {
            rows: self.batch.clone(),
            on: self.compute,
        });
    }

    /// Takes in what the worker and the image decoders finished.
    fn receive(&mut self, ctx: &egui::Context) {
        while let Ok((path, decoded)) = self.decoded.try_recv() {
            match decoded {
                Ok(pixels) => {
                    if let Some(entry) = self.images.iter_mut().find(|i| i.path == path) {
                        let texture = ctx.load_texture(
                            path.display().to_string(),
                            pixels,
                            TextureOptions::LINEAR,
                        );
                        entry.picture = Picture::Ready(texture);
                    }
                }
                Err(error) => {
                    self.errors.push(error);
                    self.images.retain(|i| i.path != path);
                }
            }
        }
        loop {
            let reply = match self.replies.try_recv() {
                Ok(reply) => reply,
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    if self.running {
                        self.running = false;
                        self.errors.push("the compute thread stopped".to_owned());
                    }
                    return;
                }
            };
            match reply {
                Reply::AdapterLoaded(info) => {
                    self.adapters.retain(|a| a.name != info.name);
                    self.adapters.push(info);
                }
                Reply::AdapterUnloaded(name) => self.adapters.retain(|a| a.name != name),
                Reply::Progress(text) => self.progress = text,
                Reply::RunDone(result) => {
                    self.running = false;
                    let run = self.history.len() as f64 + 1.0;
                    self.history
                        .push([run, result.requests as f64 / result.seconds.max(1e-9)]);
                    self.selected = self.selected.min(result.rows.len().saturating_sub(1));
                    self.result = Some(*result);
                }
                Reply::RunFailed(error) => {
                    self.running = false;
                    self.errors.push(error);
                }
                Reply::Failed(error) => self.errors.push(error),
            }
        }
    }

    /// The texture of image `path` once it is decoded; the first call starts decoding it on a
    /// thread of its own, so that a large image does not stall the window.
    fn texture(&mut self, ctx: &egui::Context, path: &Path) -> Option<TextureHandle> {
        let entry = self.images.iter_mut().find(|i| i.path == path)?;
        match &entry.picture {
            Picture::Ready(texture) => Some(texture.clone()),
            Picture::Loading => None,
            Picture::NotLoaded => {
                entry.picture = Picture::Loading;
                let (decoder, path, ctx) = (self.decoder.clone(), path.to_owned(), ctx.clone());
                std::thread::spawn(move || {
                    let pixels = decode_picture(&path);
                    if decoder.send((path, pixels)).is_ok() {
                        ctx.request_repaint();
                    }
                });
                None
            }
        }
    }

    fn screenshot_step(&mut self, ctx: &egui::Context) {
        let Some(plan) = &mut self.screenshot else {
            return;
        };
        let decoding = self
            .images
            .iter()
            .any(|i| matches!(i.picture, Picture::Loading));
        if self.running || decoding {
            // The worker's reply and each decoded picture wake the window; frames drawn before
            // then would take the cores from the batch (on a software GPU, all of them).
            return;
        }
        ctx.request_repaint();
        if let Some(outcome) = plan.saved.lock().expect("not poisoned").take() {
            if let Err(error) = outcome {
                self.errors.push(error);
            }
            if !self.errors.is_empty() {
                eprintln!("demo errors: {}", self.errors.join("; "));
                SCREENSHOT_RUN_FAILED.store(true, Ordering::SeqCst);
            }
            ctx.send_viewport_cmd(ViewportCommand::Close);
            return;
        }
        plan.rendered += 1;
        if plan.rendered >= plan.frames && !plan.requested {
            plan.requested = true;
            // In pixels, for the test that checks the screenshot.
            let scale = ctx.pixels_per_point();
            for (name, rect) in ["heatmap", "results"].into_iter().zip(self.drawn) {
                if let Some(rect) = rect {
                    println!(
                        "{name}: {} {} {} {}",
                        (rect.min.x * scale).round(),
                        (rect.min.y * scale).round(),
                        (rect.max.x * scale).round(),
                        (rect.max.y * scale).round()
                    );
                }
            }
            let (file, saved) = (plan.file.clone(), plan.saved.clone());
            let wake = ctx.clone();
            ctx.send_viewport_cmd(ViewportCommand::Screenshot(egui::ScreenshotCallback::new(
                move |image| {
                    *saved.lock().expect("not poisoned") = Some(save_png(&image, &file));
                    wake.request_repaint();
                },
            )));
        }
    }
}

impl eframe::App for DemoApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        let ctx = ui.ctx().clone();
        self.receive(&ctx);
        for file in ctx.input(|i| i.raw.dropped_files.clone()) {
            let path = file.path().to_owned();
            if path.is_dir() {
                self.load_adapter(path);
            } else if !path.as_os_str().is_empty() {
                self.add_image(path);
            }
        }
        egui::Panel::top("device").show(ui, |ui| self.device_bar(ui));
        egui::Panel::bottom("errors").show(ui, |ui| self.error_list(ui));
        egui::Panel::left("inputs")
            .default_size(330.0)
            .show(ui, |ui| {
                egui::ScrollArea::vertical().show(ui, |ui| {
                    self.image_list(ui);
                    ui.separator();
                    self.adapter_list(ui);
                })
            });
        egui::CentralPanel::default().show(ui, |ui| {
            egui::ScrollArea::vertical().show(ui, |ui| {
                self.batch_table(ui);
                ui.separator();
                self.results(ui);
            })
        });
        if self.running {
            // The worker wakes the window with each reply; this is only a slow check besides it,
            // as each frame costs a software GPU the cores the batch runs on.
            ctx.request_repaint_after(std::time::Duration::from_secs(1));
        }
        self.screenshot_step(&ctx);
    }
}

impl DemoApp {
    fn device_bar(&mut self, ui: &mut egui::Ui) {
        ui.horizontal(|ui| {
            ui.heading("mmlora");
            ui.separator();
            let mut picked = None;
            ui.add_enabled_ui(!self.running, |ui| {
                egui::ComboBox::from_label("model")
                    .selected_text(file_name(&self.model_dir))
                    .show_ui(ui, |ui| {
                        for model in &self.models {
                            let current = *model == self.model_dir;
                            if ui.selectable_label(current, file_name(model)).clicked() && !current
                            {
                                picked = Some(model.clone());
                            }
                        }
                    });
            });
            if let Some(model) = picked {
                self.switch_model(model);
            }
            ui.separator();
            match &self.gpu {
                Some(gpu) => ui.label(format!("GPU (rendering and compute): {gpu}")),
                None => ui.colored_label(Color32::YELLOW, "no GPU for compute"),
            };
            ui.separator();
            ui.label("compute on");
            ui.add_enabled_ui(self.gpu.is_some(), |ui| {
                ui.radio_value(&mut self.compute, Compute::Gpu, "GPU");
            });
            ui.radio_value(&mut self.compute, Compute::Cpu, "CPU backend");
            ui.separator();
            let run = ui.add_enabled(!self.running, egui::Button::new("Run batch"));
            if run.clicked() {
                self.run();
            }
            if self.running {
                // Words, not egui's spinner: a spinner asks for the next frame at once, every
                // frame, and on a software GPU those frames took the cores from the batch.
                ui.label(format!("working: {}", self.progress));
            }
        });
    }

    fn error_list(&mut self, ui: &mut egui::Ui) {
        let mut dismissed = None;
        for (i, error) in self.errors.iter().enumerate() {
            ui.horizontal(|ui| {
                if ui.small_button("remove").clicked() {
                    dismissed = Some(i);
                }
                ui.colored_label(Color32::from_rgb(255, 110, 110), error);
            });
        }
        if let Some(i) = dismissed {
            self.errors.remove(i);
        }
        if self.errors.is_empty() {
            ui.label("Drop image files or PEFT adapter folders on the window to add them.");
        }
    }

    fn image_list(&mut self, ui: &mut egui::Ui) {
        ui.heading("Images");
        let mut removed = None;
        for (i, entry) in self.images.iter().enumerate() {
            ui.horizontal(|ui| {
                if ui.small_button("remove").clicked() {
                    removed = Some(i);
                }
                ui.label(file_name(&entry.path));
            });
        }
        if let Some(i) = removed {
            self.images.remove(i);
        }
        ui.horizontal(|ui| {
            ui.text_edit_singleline(&mut self.image_path);
            if ui.button("Add image").clicked() && !self.image_path.trim().is_empty() {
                let path = PathBuf::from(self.image_path.trim());
                if path.is_file() {
                    self.add_image(path);
                    self.image_path.clear();
                } else {
                    self.errors
                        .push(format!("{} is not a file", path.display()));
                }
            }
        });
    }

    fn adapter_list(&mut self, ui: &mut egui::Ui) {
        ui.heading("Adapters");
        let mut unload = None;
        for adapter in &self.adapters {
            ui.group(|ui| {
                ui.horizontal(|ui| {
                    ui.strong(&adapter.name)
                        .on_hover_text(adapter.dir.display().to_string());
                    ui.label(&adapter.summary);
                    if ui.small_button("Unload").clicked() {
                        unload = Some(adapter.name.clone());
                    }
                });
                ui.small(&adapter.targets);
            });
        }
        if let Some(name) = unload {
            let _ = self.jobs.send(Job::Unload(name.clone()));
            for row in &mut self.batch {
                if row.adapter.as_ref() == Some(&name) {
                    row.adapter = None;
                }
            }
        }
        ui.horizontal(|ui| {
            ui.text_edit_singleline(&mut self.adapter_path);
            if ui.button("Load adapter").clicked() && !self.adapter_path.trim().is_empty() {
                self.load_adapter(PathBuf::from(self.adapter_path.trim()));
                self.adapter_path.clear();
            }
        });
    }

    fn batch_table(&mut self, ui: &mut egui::Ui) {
        ui.heading("Batch (one engine call)");
        let images: Vec<PathBuf> = self.images.iter().map(|i| i.path.clone()).collect();
        let adapters: Vec<String> = self.adapters.iter().map(|a| a.name.clone()).collect();
        let mut removed = None;
        egui::Grid::new("batch").striped(true).show(ui, |ui| {
            ui.strong("row");
            ui.strong("image");
            ui.strong("adapter");
            ui.end_row();
            for (i, row) in self.batch.iter_mut().enumerate() {
                ui.label(i.to_string());
                egui::ComboBox::from_id_salt(("image", i))
                    .selected_text(file_name(&row.image))
                    .show_ui(ui, |ui| {
                        for image in &images {
                            ui.selectable_value(&mut row.image, image.clone(), file_name(image));
                        }
                    });
                egui::ComboBox::from_id_salt(("adapter", i))
                    .selected_text(row.adapter.as_deref().unwrap_or("none"))
                    .show_ui(ui, |ui| {
                        ui.selectable_value(&mut row.adapter, None, "none");
                        for name in &adapters {
                            ui.selectable_value(&mut row.adapter, Some(name.clone()), name);
                        }
                    });
                if ui.small_button("remove").clicked() {
                    removed = Some(i);
                }
                ui.end_row();
            }
        });
        if let Some(i) = removed {
            self.batch.remove(i);
        }
        if ui.button("Add row").clicked()
            && let Some(image) = images.first()
        {
            self.batch.push(BatchRow {
                image: image.clone(),
                adapter: None,
            });
        }
    }

    fn results(&mut self, ui: &mut egui::Ui) {
        let Some(result) = self.result.clone() else {
            ui.label("No results yet.");
            return;
        };
        ui.heading(format!(
            "Results: {} requests (rows + one base per image) in {:.2} s on {}",
            result.requests, result.seconds, result.device
        ));
        if self.history.len() == 1 {
            ui.small("The first run on a device includes compiling (and on a GPU autotuning) its kernels.");
        }
        let table = egui::Grid::new("results").striped(true).show(ui, |ui| {
            for title in [
                "row",
                "image",
                "adapter",
                "tokens (tower -> embeds)",
                "moved",
                "step",
                "step time",
            ] {
                ui.strong(title);
            }
            ui.end_row();
            for (i, row) in result.rows.iter().enumerate() {
                ui.radio_value(&mut self.selected, i, i.to_string());
                ui.label(file_name(&row.image));
                ui.label(row.adapter.as_deref().unwrap_or("none"));
                ui.label(format!("{} -> {}", row.tower_tokens, row.embeds));
                ui.label(format!("{:.1} %", row.moved * 100.0));
                ui.label((row.step + 1).to_string());
                ui.label(format!("{:.1} ms", row.step_ms));
                ui.end_row();
            }
        });
        self.drawn[1] = Some(table.response.rect);
        ui.add_space(8.0);
        ui.horizontal_top(|ui| {
            if let Some(row) = result.rows.get(self.selected) {
                ui.vertical(|ui| {
                    ui.strong(format!(
                        "Row {}: L2 distance of each patch's tower output from the base model ({} with {})",
                        self.selected,
                        file_name(&row.image),
                        row.adapter.as_deref().unwrap_or("no adapter")
                    ));
                    let texture = self.texture(ui.ctx(), &row.image);
                    self.drawn[0] = Some(heatmap(ui, texture.as_ref(), &row.heat));
                });
            }
            ui.separator();
            ui.vertical(|ui| {
                ui.strong("Cosine similarity of pooled embeddings");
                cosine_matrix(ui, &result.cosine);
                ui.add_space(8.0);
                ui.strong("Throughput over runs (requests/s)");
                let line: Vec<[f64; 2]> = self.history.clone();
                Plot::new("throughput")
                    .height(150.0)
                    .width(320.0)
                    .allow_scroll(false)
                    .show(ui, |plot| {
                        plot.line(Line::new("requests/s", PlotPoints::from(line.clone())));
                        plot.points(Points::new("runs", PlotPoints::from(line)).radius(3.0));
                    });
            });
        });
    }
}

/// The image with each patch tinted by its value, and a colour bar with the scale; returns the
/// image's rectangle.
fn heatmap(ui: &mut egui::Ui, texture: Option<&TextureHandle>, heat: &Heat) -> Rect {
    let (rows, columns) = (heat.rows.max(1) as f32, heat.columns.max(1) as f32);
    let (width, height) = if rows > columns {
        (HEATMAP_SIDE * columns / rows, HEATMAP_SIDE)
    } else {
        (HEATMAP_SIDE, HEATMAP_SIDE * rows / columns)
    };
    let bar = 70.0;
    let (response, painter) = ui.allocate_painter(Vec2::new(width + bar, height), Sense::hover());
    let area = Rect::from_min_size(response.rect.min, Vec2::new(width, height));
    if let Some(texture) = texture {
        let uv = Rect::from_min_max(Pos2::ZERO, Pos2::new(1.0, 1.0));
        painter.image(texture.id(), area, uv, Color32::WHITE);
    }
    let max = heat.max();
    let cell = Vec2::new(width / columns, height / rows);
    for row in 0..heat.rows {
        for column in 0..heat.columns {
            let value = heat.values[row * heat.columns + column];
            let min = area.min + Vec2::new(column as f32 * cell.x, row as f32 * cell.y);
            let color = colormap(if max > 0.0 { value / max } else { 0.0 });
            painter.rect_filled(
                Rect::from_min_size(min, cell),
                0.0,
                Color32::from_rgba_unmultiplied(color.r(), color.g(), color.b(), 170),
            );
        }
    }
    // Colour bar: 0 at the bottom, the largest change at the top.
    let strip = Rect::from_min_size(
        Pos2::new(area.max.x + 8.0, area.min.y),
        Vec2::new(14.0, height),
    );
    let steps = 48;
    for i in 0..steps {
        let t = 1.0 - i as f32 / steps as f32;
        let y = strip.min.y + i as f32 * height / steps as f32;
        painter.rect_filled(
            Rect::from_min_size(
                Pos2::new(strip.min.x, y),
                Vec2::new(14.0, height / steps as f32 + 0.5),
            ),
            0.0,
            colormap(t),
        );
    }
    for (t, anchor) in [
        (1.0, Align2::LEFT_TOP),
        (0.5, Align2::LEFT_CENTER),
        (0.0, Align2::LEFT_BOTTOM),
    ] {
        painter.text(
            Pos2::new(strip.max.x + 4.0, strip.max.y - t * height),
            anchor,
            format!("{:.3}", max * t),
            FontId::proportional(11.0),
            ui.visuals().text_color(),
        );
    }
    area
}

/// The matrix as coloured cells with their values.
fn cosine_matrix(ui: &mut egui::Ui, matrix: &[Vec<f32>]) {
    let n = matrix.len();
    let cell = 44.0;
    let (response, painter) = ui.allocate_painter(
        Vec2::new(cell * (n as f32 + 1.0), cell * (n as f32 + 1.0)),
        Sense::hover(),
    );
    let origin = response.rect.min + Vec2::splat(cell);
    let text = ui.visuals().text_color();
    for (i, similarities) in matrix.iter().enumerate() {
        let offset = (i as f32 + 0.5) * cell;
        for pos in [
            Pos2::new(origin.x - cell / 2.0, origin.y + offset),
            Pos2::new(origin.x + offset, origin.y - cell / 2.0),
        ] {
            painter.text(
                pos,
                Align2::CENTER_CENTER,
                i.to_string(),
                FontId::proportional(12.0),
                text,
            );
        }
        for (j, &value) in similarities.iter().enumerate() {
            let rect = Rect::from_min_size(
                origin + Vec2::new(j as f32 * cell, i as f32 * cell),
                Vec2::splat(cell - 2.0),
            );
            painter.rect_filled(rect, 2.0, colormap((value + 1.0) / 2.0));
            let ink = if value > 0.3 {
                Color32::BLACK
            } else {
                Color32::WHITE
            };
            painter.text(
                rect.center(),
                Align2::CENTER_CENTER,
                format!("{value:.2}"),
                FontId::proportional(11.0),
                ink,
            );
        }
    }
}

/// An inferno-like colour scale over `t` in 0..=1.
fn colormap(t: f32) -> Color32 {
    let [r, g, b] = analysis::colormap(t);
    Color32::from_rgb(r, g, b)
}

/// Whether `dir` is a PEFT adapter folder (has an `adapter_config.json`).
/// Starts a compute thread serving the model in `model_dir` on `gpu` (or the CPU backend),
/// waking `ctx` when it has news: its job queue and its replies.
fn start_worker(
    ctx: &egui::Context,
    model_dir: &Path,
    gpu: &Option<RuntimeDevice>,
) -> (Sender<Job>, Receiver<Reply>) {
    let (jobs, job_queue) = channel();
    let (reply_sender, replies) = channel();
    let (ctx, model_dir, gpu) = (ctx.clone(), model_dir.to_owned(), gpu.clone());
    std::thread::spawn(move || {
        worker::serve(model_dir, gpu, job_queue, reply_sender, move || {
            ctx.request_repaint()
        })
    });
    (jobs, replies)
}

fn is_adapter(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file()
}

/// The image at `path`, shrunk to fit `PICTURE_SIDE` pixels.
fn decode_picture(path: &Path) -> Result<ColorImage, String> {
    let image = mmlora::preprocess::load_image(path).map_err(|e| e.to_string())?;
    let (width, height) = image.dimensions();
    let scale = (f64::from(PICTURE_SIDE) / f64::from(width.max(height).max(1))).min(1.0);
    let fit = |side: u32| ((f64::from(side) * scale).round() as u32).max(1);
    let image = image::imageops::thumbnail(&image, fit(width), fit(height));
    Ok(ColorImage::from_rgb(
        [image.width() as usize, image.height() as usize],
        image.as_raw(),
    ))
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn save_png(image: &ColorImage, file: &Path) -> Result<(), String> {
    let [width, height] = image.size;
    let bytes: Vec<u8> = image.pixels.iter().flat_map(|p| p.to_array()).collect();
    image::RgbaImage::from_raw(width as u32, height as u32, bytes)
        .ok_or_else(|| "screenshot has the wrong size".to_owned())?
        .save(file)
        .map_err(|e| format!("cannot save {}: {e}", file.display()))
}
