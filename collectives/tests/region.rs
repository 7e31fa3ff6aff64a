//! The registered-buffer allreduce (`Comm::allreduce_region_bytes`) against the allreduce
//! of slices, with ranks as threads in one process, each with its own tcp domain and RDM
//! endpoint.

use std::sync::Arc;
use std::time::Duration;

use fabric::prelude::*;
use fabric::ErrorKind;
use fabric_collectives::{Comm, CommConfig, DataType, ReduceOp};

mod common;
use common::run_with;

const RW: Access = Access::LOCAL_WRITE.union(Access::REMOTE_WRITE);

/// Small thresholds, so that the boundaries are cheap to reach: recursive doubling up to
/// 4 KiB, the write ring above it in 4 KiB segments with 3 writes in flight.
fn small_cfg() -> CommConfig {
    CommConfig {
        small_max: 4096,
        segment: 8192,
        write_segment: 4096,
        write_window: 3,
        ..CommConfig::default()
    }
}

/// `count` elements of `dtype` from rank `rank` in call `call`, little-endian: floats whose
/// sums round differently in different orders, integers that wrap.
fn input(dtype: DataType, rank: usize, count: usize, call: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        let f = ((rank + 1) as f64).powi(7) * 1.000_1f64.powi(((i + call) % 50) as i32) / 3.0;
        let x =
            (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64 * 7919) ^ call as u64;
        match dtype {
            DataType::U8 => out.push(x as u8),
            DataType::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
            DataType::U32 => out.extend_from_slice(&(x as u32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&(x as i64).to_le_bytes()),
            DataType::U64 => out.extend_from_slice(&x.to_le_bytes()),
            DataType::F32 => out.extend_from_slice(&(f as f32).to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&f.to_le_bytes()),
        }
    }
    out
}

/// The registered region's result.
fn region_allreduce(
    c: &mut Comm,
    region: &MemoryRegion,
    data: &[u8],
    dtype: DataType,
    op: ReduceOp,
) -> Vec<u8> {
    region.buffer().write(0, data);
    c.allreduce_region_bytes(region.slice(..data.len()).unwrap(), dtype, op)
        .unwrap();
    region.buffer().to_vec(0, data.len())
}

/// For 2 to 5 ranks, every type and operator, element counts just under, at and over
/// `small_max` and one and several segments per block: the registered region ends up
/// with exactly the bits the allreduce of a slice gives, on every rank (and every rank
/// holds the same bits).
#[test]
fn region_matches_the_slice_allreduce_bit_for_bit() {
    for n in 2usize..=5 {
        let out = run_with(n, small_cfg(), move |c, d| {
            let region = d.alloc(64 << 10, RW).expect("register");
            let mut res = Vec::new();
            for dtype in DataType::ALL {
                let es = dtype.size();
                let small = 4096 / es;
                let seg = 4096 / es;
                let mut counts = vec![small - 1, small, small + 1, n * seg - 1, n * seg + 1];
                counts.push(3 * n * seg + 5); // several segments per block
                for count in counts {
                    for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                        let data = input(dtype, c.rank(), count, count);
                        let mut slice = data.clone();
                        c.allreduce_bytes(&mut slice, dtype, op).unwrap();
                        let reg = region_allreduce(c, &region, &data, dtype, op);
                        res.push((dtype, count, op, slice, reg));
                    }
                }
            }
            res
        });
        for (r, rank) in out.iter().enumerate() {
            for (k, (dtype, count, op, slice, reg)) in rank.iter().enumerate() {
                let what = format!("n {n} rank {r} {dtype} {op} count {count}");
                assert_eq!(reg, slice, "{what}: region != slice");
                assert_eq!(reg, &out[0][k].4, "{what}: ranks differ");
            }
        }
        // And the integers are right: the wrapping sum, min and max of every rank's input.
        for (dtype, count, op, _, reg) in &out[0] {
            if *dtype != DataType::I64 {
                continue;
            }
            let vals: Vec<Vec<i64>> = (0..n)
                .map(|r| {
                    input(DataType::I64, r, *count, *count)
                        .chunks(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                        .collect()
                })
                .collect();
            for (i, got) in reg.chunks(8).enumerate() {
                let col = vals.iter().map(|v| v[i]);
                let want = match op {
                    ReduceOp::Sum => col.fold(0i64, i64::wrapping_add),
                    ReduceOp::Min => col.min().unwrap(),
                    ReduceOp::Max => col.max().unwrap(),
                };
                assert_eq!(
                    i64::from_le_bytes(got.try_into().unwrap()),
                    want,
                    "{op} [{i}]"
                );
            }
        }
    }
}

/// Regions reused across calls and changed between them: the same region again with new
/// data, a slice of it at another offset, a new region on one rank only (its descriptor
/// goes round, the others' do not), a larger payload (the landing buffers grow), calls of
/// slices in between (the ring's own work buffer is made then), and the first region
/// again. Every call gives the slice allreduce's bits.
#[test]
fn regions_reused_and_changed_across_calls() {
    for n in [2usize, 3, 4] {
        let out = run_with(n, small_cfg(), move |c, d| {
            let a = d.alloc(200_000, RW).expect("register");
            let b = d.alloc(100_000, RW).expect("register");
            let dtype = DataType::F32;
            let mut res = Vec::new();
            // (call, region, offset, count); region 2 = `b` on rank 1 only, else `a`.
            let plan: [(usize, usize, usize); 9] = [
                (0, 0, 10_000),
                (0, 0, 10_000),
                (0, 64, 10_000),
                (2, 0, 10_000),
                (2, 0, 10_000),
                (0, 0, 40_000),
                (1, 8, 20_000),
                (0, 0, 20_000),
                (0, 0, 10_000),
            ];
            for (call, &(which, offset, count)) in plan.iter().enumerate() {
                let region = match which {
                    1 => &b,
                    2 if c.rank() == 1 => &b,
                    _ => &a,
                };
                let data = input(dtype, c.rank(), count, call);
                let mut slice = data.clone();
                c.allreduce_bytes(&mut slice, dtype, ReduceOp::Sum).unwrap();
                let len = data.len();
                let in_place = |c: &mut Comm| {
                    region.buffer().write(offset, &data);
                    c.allreduce_region_bytes(
                        region.slice(offset..offset + len).unwrap(),
                        dtype,
                        ReduceOp::Sum,
                    )
                    .unwrap();
                    region.buffer().to_vec(offset, len)
                };
                let first = in_place(c);
                // Back to back, no slice call between: the same region again.
                let again = in_place(c);
                res.push((slice.clone(), first));
                res.push((slice, again));
            }
            res
        });
        for (r, rank) in out.iter().enumerate() {
            for (k, (slice, reg)) in rank.iter().enumerate() {
                assert_eq!(reg, slice, "n {n} rank {r} call {k}: region != slice");
                assert_eq!(reg, &out[0][k].1, "n {n} rank {r} call {k}: ranks differ");
            }
        }
    }
}

/// A region without remote write access is refused on every rank before anything is sent
/// (the communicator goes on working); a rank whose length differs from the others' is named
/// by a rank that hears its descriptor first, which fails with `Protocol` (the others wait
/// for notifications that never come and fail at the step timeout). With 3 ranks (the
/// write ring) that is rank 2, the previous rank of rank 0; with 4 (halving and doubling)
/// also rank 2, rank 0's partner at the first level.
#[test]
fn bad_regions_are_refused() {
    for n in [3usize, 4] {
        let cfg = CommConfig {
            timeout: Duration::from_secs(3),
            ..small_cfg()
        };
        // Every rank stays until all have returned: a rank that fails first and drops its
        // endpoint would fail the others' operations to it (disconnected) before they find
        // the mismatch themselves.
        let all_returned = Arc::new(std::sync::Barrier::new(n));
        let out = run_with(n, cfg, move |c, d| {
            let local = d.alloc(40_000, Access::LOCAL_WRITE).expect("register");
            let refused = c
                .allreduce_region::<f32>(&local, 10_000, ReduceOp::Sum)
                .unwrap_err();
            // Still usable: the refusal sent nothing.
            let region = d.alloc(40_004, RW).expect("register");
            let data = input(DataType::I32, c.rank(), 10_000, 0);
            let mut slice = data.clone();
            c.allreduce_bytes(&mut slice, DataType::I32, ReduceOp::Max)
                .unwrap();
            let ok = region_allreduce(c, &region, &data, DataType::I32, ReduceOp::Max) == slice;
            // Rank 0 passes one element more than the others.
            let count = 10_000 + usize::from(c.rank() == 0);
            let mismatched = c.allreduce_region::<i32>(&region, count, ReduceOp::Max);
            all_returned.wait();
            (refused, ok, mismatched.err())
        });
        for (r, (refused, ok, mismatched)) in out.iter().enumerate() {
            assert_eq!(
                refused.kind(),
                ErrorKind::LocalProtection,
                "n {n} rank {r}: {refused}"
            );
            assert!(refused.message().contains("REMOTE_WRITE"), "{refused}");
            assert!(ok, "n {n} rank {r}: the call after a refusal");
            let e = mismatched
                .as_ref()
                .expect("a mismatched call fails everywhere");
            if r == 2 {
                // (Others may find the mismatch too, unless a rank stopped before it
                // passed the descriptor on or wrote its half.)
                assert_eq!(e.kind(), ErrorKind::Protocol, "n {n} rank {r}: {e}");
                assert!(e.message().contains("same length"), "n {n} rank {r}: {e}");
            }
        }
    }
}
