//! Splitting one `encode` call into scheduler steps that each fit the GPU slots.

/// Tells a call's adapters apart (any id; equal ids are the same adapter).
pub type AdapterTag = usize;

/// What the planner needs to know of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanItem {
    /// The request's adapter, if any.
    pub adapter: Option<AdapterTag>,
    /// Its tower rows.
    pub rows: usize,
}

/// Groups requests (by index) into steps of at most `max_loras` distinct adapters and at most
/// `max_rows` tower rows (a single larger request gets a step of its own).
///
/// Adapters are taken `max_loras` at a time in order of first appearance, so each adapter's
/// requests share one step unless the row limit splits its group (then a group's tail may share
/// a step with the next group's head); requests without adapter ride with the first group.
/// Within a step, requests keep their order.
pub fn plan_steps(items: &[PlanItem], max_loras: usize, max_rows: usize) -> Vec<Vec<usize>> {
    let mut first_seen: Vec<AdapterTag> = Vec::new();
    for key in items.iter().filter_map(|item| item.adapter) {
        if !first_seen.contains(&key) {
            first_seen.push(key);
        }
    }
    let group = |item: &PlanItem| {
        item.adapter.map_or(0, |key| {
            first_seen.iter().position(|&k| k == key).unwrap_or(0) / max_loras.max(1)
        })
    };
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| group(&items[i])); // stable: request order within a group

    let mut steps: Vec<Vec<usize>> = Vec::new();
    let (mut adapters, mut rows): (Vec<AdapterTag>, usize) = (Vec::new(), 0);
    for i in order {
        let item = items[i];
        let new_adapter = item.adapter.filter(|key| !adapters.contains(key));
        let full = adapters.len() + usize::from(new_adapter.is_some()) > max_loras
            || rows + item.rows > max_rows;
        if steps.is_empty() || full {
            steps.push(Vec::new());
            adapters.clear();
            rows = 0;
        }
        if let Some(key) = item.adapter.filter(|key| !adapters.contains(key)) {
            adapters.push(key);
        }
        rows += item.rows;
        steps.last_mut().expect("a step was pushed").push(i);
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn item(adapter: Option<AdapterTag>, rows: usize) -> PlanItem {
        PlanItem { adapter, rows }
    }

    #[test]
    fn everything_fits_in_one_step() {
        let items = [
            item(Some(1), 4),
            item(None, 4),
            item(Some(2), 4),
            item(Some(1), 4),
        ];
        assert_eq!(plan_steps(&items, 2, 100), vec![vec![0, 1, 2, 3]]);
    }

    #[test]
    fn more_adapters_than_slots_split_by_adapter() {
        let items = [
            item(Some(1), 4),
            item(Some(2), 4),
            item(Some(3), 4),
            item(None, 4),
            item(Some(1), 4),
        ];
        // Adapters 1 and 2 (and the no-adapter request) first, then adapter 3.
        assert_eq!(plan_steps(&items, 2, 100), vec![vec![0, 1, 3, 4], vec![2]]);
    }

    #[test]
    fn row_limit_splits_and_a_large_request_runs_alone() {
        let items = [item(None, 4), item(None, 4), item(None, 10), item(None, 1)];
        assert_eq!(plan_steps(&items, 1, 8), vec![vec![0, 1], vec![2], vec![3]]);
    }

    proptest! {
        /// Every request is planned exactly once, and no step exceeds the slots (or the rows,
        /// unless it holds a single request).
        #[test]
        fn steps_cover_every_request_within_the_limits(
            adapters in prop::collection::vec(prop::option::of(1usize..12), 0..40),
            max_loras in 1usize..5,
            max_rows in 1usize..20,
        ) {
            let items: Vec<PlanItem> = adapters
                .iter()
                .enumerate()
                .map(|(i, &a)| item(a, 1 + i % 7))
                .collect();
            let steps = plan_steps(&items, max_loras, max_rows);
            let mut seen: Vec<usize> = steps.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..items.len()).collect::<Vec<_>>());
            for step in &steps {
                prop_assert!(!step.is_empty());
                let mut distinct: Vec<AdapterTag> =
                    step.iter().filter_map(|&i| items[i].adapter).collect();
                distinct.sort_unstable();
                distinct.dedup();
                prop_assert!(distinct.len() <= max_loras);
                let rows: usize = step.iter().map(|&i| items[i].rows).sum();
                prop_assert!(rows <= max_rows || step.len() == 1);
            }
        }
    }
}
