//! Model test of the slot table with a tiny tag space, so that tags collide, buckets
//! overflow into their neighbours and tombstones pile up.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use proptest::prelude::*;

use super::super::table::SlotTable;

#[derive(Clone, Debug)]
enum Op {
    Insert(u32, u32),
    Remove(u32),
    /// Room for this many more entries: the table must not grow before they are in.
    Reserve(u32),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    // Tags (always odd) share their top bits (one home bucket for small tables) or differ.
    let tag = prop_oneof![(0u32..4).prop_map(|t| t << 28), 0u32..4, any::<u32>()].prop_map(|t| t | 1);
    let op = prop_oneof![2 => (0u32..300, tag).prop_map(|(s, t)| Op::Insert(s, t)), 1 => (0u32..300).prop_map(Op::Remove), 1 => (0u32..40).prop_map(Op::Reserve)];
    proptest::collection::vec(op, 0..400)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn slot_table_agrees_with_a_map(ops in ops()) {
        let mut table = SlotTable::new();
        let mut model: BTreeMap<u32, u32> = BTreeMap::new();
        // Entries up to which the table keeps its size, after a reserve.
        let mut reserved: Option<(usize, usize)> = None;
        for op in ops {
            match op {
                Op::Insert(slot, tag) => {
                    if let alloc::collections::btree_map::Entry::Vacant(e) = model.entry(slot) {
                        e.insert(tag);
                        table.insert(tag, slot);
                    }
                    if let Some((until, buckets)) = reserved {
                        if table.len() <= until {
                            prop_assert_eq!(table.buckets(), buckets, "grew within a reservation");
                        } else {
                            reserved = None;
                        }
                    }
                }
                Op::Reserve(n) => {
                    table.reserve(n as usize);
                    reserved = Some((table.len() + n as usize, table.buckets()));
                }
                Op::Remove(slot) => {
                    if let Some(tag) = model.remove(&slot) {
                        table.remove(tag, slot);
                    }
                }
            }
            prop_assert_eq!(table.len(), model.len());
        }
        for slot in 0..300u32 {
            for tag in [1, 1 << 28 | 1, 3, 3 << 28 | 1] {
                let want = (model.get(&slot) == Some(&tag)).then_some(slot);
                prop_assert_eq!(table.find(tag, |s| s == slot), want);
            }
            if let Some(&tag) = model.get(&slot) {
                prop_assert_eq!(table.find(tag, |s| s == slot), Some(slot));
            }
        }
    }
}
