//! The reference implementation on the CPU backend: for each slot's rows, gather them, run the
//! two small matmuls, and add the result back into those rows of the slice's columns.

use burn::backend::{
    Flex,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{IndexingUpdateOp, Int, Tensor};

use super::{LoraBackend, LoraPlan};

impl LoraBackend for Flex {
    fn lora_apply(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        sorted_tokens: IntTensor<Self>,
        _tiles: IntTensor<Self>,
        plan: LoraPlan,
        out_offset: usize,
    ) -> FloatTensor<Self> {
        let x = Tensor::<2>::from_primitive::<Flex>(x);
        let y = Tensor::<2>::from_primitive::<Flex>(base);
        let a = Tensor::<3>::from_primitive::<Flex>(lora_a);
        let b = Tensor::<3>::from_primitive::<Flex>(lora_b);
        let sorted = Tensor::<1, Int>::from_primitive::<Flex>(sorted_tokens);

        let [rows, _] = y.dims();
        let [_, out, _] = b.dims();
        let columns = out_offset..out_offset + out;
        let mut slice = y.clone().slice([0..rows, columns.clone()]);
        for segment in plan.0.lora_segments() {
            let slot = segment.slot as usize;
            let rows_of_slot = sorted
                .clone()
                .slice(segment.start..segment.start + segment.len);
            let a_slot = a.clone().slice(slot..slot + 1).squeeze_dim::<2>(0); // [rank, in]
            let b_slot = b.clone().slice(slot..slot + 1).squeeze_dim::<2>(0); // [out, rank]
            let shrunk = x
                .clone()
                .select(0, rows_of_slot.clone())
                .matmul(a_slot.transpose());
            let delta = shrunk.matmul(b_slot.transpose());
            slice = slice.select_assign(0, rows_of_slot, delta, IndexingUpdateOp::Add);
        }
        y.slice_assign([0..rows, columns], slice)
            .try_into_primitive::<Flex>()
            .expect("a Flex tensor stays on Flex")
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Problem, assert_matches, problems, reference};
    use crate::device;
    use proptest::prelude::*;

    /// The native op against a float64 per-row loop, within the f32 error bound.
    fn check(problem: &Problem) {
        let cpu = device::cpu();
        let data = problem.data(&cpu);
        let expected = reference(problem, &data);
        let y = data.apply(problem, &cpu);
        // Tolerance: Higham's bound for the two chained f32 dot products (see `Reference`).
        assert_matches(problem, &data, &expected, &y, 1.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 0, ..ProptestConfig::default() })]
        #[test]
        fn native_matches_float64(problem in problems()) {
            check(&problem);
        }
    }
}
