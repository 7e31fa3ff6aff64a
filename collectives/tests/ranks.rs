//! Ranks as threads in one process, each with its own tcp domain and RDM endpoint.

mod common;

use fabric_collectives::{Comm, CommConfig, DataType, ReduceOp};

fn run<R: Send + 'static>(n: usize, f: impl Fn(&mut Comm) -> R + Send + Sync + 'static) -> Vec<R> {
    // Small segments: large transfers go in many messages.
    let cfg = CommConfig {
        segment: 8192,
        ..CommConfig::default()
    };
    run_with(n, cfg, f)
}

fn run_with<R: Send + 'static>(
    n: usize,
    cfg: CommConfig,
    f: impl Fn(&mut Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    common::run_with(n, cfg, move |c, _| f(c))
}

fn value(rank: usize, i: usize) -> i64 {
    ((rank * 7 + i * 13) % 23) as i64 - 11
}

/// `count` floats of rank `rank` in call `call`, whose sums round differently in different
/// orders.
fn floats(rank: usize, count: usize, call: usize) -> Vec<f32> {
    (0..count)
        .map(|i| ((rank + 1) as f32).powi(7) * 1.000_1f32.powi((i + call) as i32 % 50) / 3.0)
        .collect()
}

#[test]
fn allreduce_every_type_and_op_small_and_large() {
    for n in [3usize, 4] {
        let out = run(n, move |c| {
            let mut res = Vec::new();
            for count in [1usize, 5, 1000, 40_000] {
                for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                    let mut a: Vec<i32> = (0..count).map(|i| value(c.rank(), i) as i32).collect();
                    c.allreduce(&mut a, op).unwrap();
                    let mut f: Vec<f64> = (0..count)
                        .map(|i| value(c.rank(), i) as f64 * 0.5)
                        .collect();
                    c.allreduce(&mut f, op).unwrap();
                    let mut u: Vec<u8> = (0..count).map(|i| value(c.rank(), i) as u8).collect();
                    c.allreduce(&mut u, op).unwrap();
                    res.push((count, op, a, f, u));
                }
            }
            res
        });
        for rank in &out {
            for (count, op, a, f, u) in rank {
                for i in 0..*count {
                    let vals: Vec<i64> = (0..n).map(|r| value(r, i)).collect();
                    let want = match op {
                        ReduceOp::Sum => vals.iter().sum::<i64>(),
                        ReduceOp::Min => *vals.iter().min().unwrap(),
                        ReduceOp::Max => *vals.iter().max().unwrap(),
                    };
                    assert_eq!(a[i] as i64, want, "n {n} count {count} {op} i32 [{i}]");
                    assert_eq!(
                        f[i],
                        want as f64 * 0.5,
                        "n {n} count {count} {op} f64 [{i}]"
                    );
                    let wu = match op {
                        ReduceOp::Sum => vals.iter().fold(0u8, |s, &v| s.wrapping_add(v as u8)),
                        ReduceOp::Min => vals.iter().map(|&v| v as u8).min().unwrap(),
                        ReduceOp::Max => vals.iter().map(|&v| v as u8).max().unwrap(),
                    };
                    assert_eq!(u[i], wu, "n {n} count {count} {op} u8 [{i}]");
                }
            }
        }
    }
}

#[test]
fn float_results_are_bit_identical_on_every_rank() {
    for n in [3usize, 5] {
        let out = run(n, |c| {
            let mut v = Vec::new();
            for count in [7usize, 100_000] {
                let mut f = floats(c.rank(), count, 0);
                c.allreduce(&mut f, ReduceOp::Sum).unwrap();
                v.push(f.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            v
        });
        for r in &out[1..] {
            assert_eq!(r, &out[0], "rank results differ in their bits (n {n})");
        }
    }
}

/// The write ring (many small segments, a small window, blocks of uneven length, buffers
/// that grow between calls, calls back to back) gives the same bits as the ring of tagged
/// messages, on every rank.
#[test]
fn write_ring_matches_the_tagged_ring_bit_for_bit() {
    for n in [2usize, 3, 4, 5] {
        let counts = [20_000usize, 20_003, 100_001, 70_000];
        let results: Vec<Vec<Vec<Vec<u32>>>> = [false, true]
            .into_iter()
            .map(|write_ring| {
                let cfg = CommConfig {
                    segment: 8192,
                    write_ring,
                    write_segment: 4096,
                    write_window: 3,
                    halving_max: 0,
                    ..CommConfig::default()
                };
                run_with(n, cfg, move |c| {
                    let mut out = Vec::new();
                    for (call, &count) in counts.iter().enumerate() {
                        for rep in 0..2 {
                            let mut f = floats(c.rank(), count, call + rep);
                            c.allreduce(&mut f, ReduceOp::Sum).unwrap();
                            out.push(f.iter().map(|x| x.to_bits()).collect());
                        }
                    }
                    out
                })
            })
            .collect();
        let (tagged, write) = (&results[0], &results[1]);
        for r in 0..n {
            assert_eq!(write[r], write[0], "write ring: ranks differ (n {n})");
            assert_eq!(write[r], tagged[r], "write ring != tagged ring (n {n})");
        }
        // And the sums are right (exact in f64 terms up to f32 rounding).
        let mut i32s = run_with(n, CommConfig::default(), move |c| {
            let mut v: Vec<i32> = (0..100_003).map(|i| value(c.rank(), i) as i32).collect();
            c.allreduce(&mut v, ReduceOp::Max).unwrap();
            v
        });
        let got = i32s.pop().unwrap();
        for (i, x) in got.iter().enumerate() {
            let want = (0..n).map(|r| value(r, i)).max().unwrap();
            assert_eq!(*x as i64, want, "n {n} max [{i}]");
        }
    }
}

/// Halving and doubling (blocks of uneven length, several segments per level, a small
/// window, buffers that grow between calls, calls back to back) gives every rank exactly the
/// bits of its fixed tree: pairs at distance `n/2` first and `1` last, the lower rank's
/// operand first.
#[test]
fn halving_doubling_is_its_pairwise_tree_bit_for_bit() {
    for n in [2usize, 4, 8] {
        let counts = [20_000usize, 20_003, 100_001, 70_000];
        let cfg = CommConfig {
            write_segment: 4096,
            write_window: 3,
            halving_max: usize::MAX,
            ..CommConfig::default()
        };
        let out = run_with(n, cfg, move |c| {
            let mut out = Vec::new();
            for (call, &count) in counts.iter().enumerate() {
                for rep in 0..2 {
                    let mut f = floats(c.rank(), count, call + rep);
                    c.allreduce(&mut f, ReduceOp::Sum).unwrap();
                    out.push(f.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
                }
            }
            out
        });
        let mut k = 0;
        for (call, &count) in counts.iter().enumerate() {
            for rep in 0..2 {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| floats(r, count, call + rep)).collect();
                for i in 0..count {
                    let mut v: Vec<f32> = inputs.iter().map(|x| x[i]).collect();
                    let mut d = n / 2;
                    while d > 0 {
                        v = (0..n).map(|r| v[r & !d] + v[r | d]).collect();
                        d /= 2;
                    }
                    for (r, rank) in out.iter().enumerate() {
                        assert_eq!(
                            rank[k][i],
                            v[0].to_bits(),
                            "n {n} count {count} call {call}.{rep} rank {r} [{i}]"
                        );
                    }
                }
                k += 1;
            }
        }
    }
}

#[test]
fn barrier_broadcast_allgather_reduce_scatter() {
    let n = 5;
    let out = run(n, move |c| {
        c.barrier().unwrap();
        let r = c.rank();
        let mut small = vec![0u64; 10];
        if r == 2 {
            small = (0..10).map(|i| i * 3 + 1).collect();
        }
        c.broadcast(&mut small, 2).unwrap();
        let mut large = vec![0u8; 1 << 20];
        if r == 4 {
            large
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i % 251) as u8);
        }
        c.broadcast(&mut large, 4).unwrap();
        let g = c.allgather(&[r as u32 * 10, r as u32 * 10 + 1]).unwrap();
        let big = c.allgather(&vec![r as u8; 100_000]).unwrap();
        let data: Vec<i64> = (0..23).map(|i| (i * (r + 1)) as i64).collect();
        let rs = c.reduce_scatter(&data, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        (small, large, g, big, rs)
    });
    for (r, (small, large, g, big, rs)) in out.iter().enumerate() {
        assert_eq!(
            small,
            &(0..10).map(|i| i * 3 + 1).collect::<Vec<u64>>(),
            "rank {r}"
        );
        assert!(
            large.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8),
            "rank {r} large broadcast"
        );
        assert_eq!(
            g,
            &(0..n as u32)
                .flat_map(|k| [k * 10, k * 10 + 1])
                .collect::<Vec<_>>()
        );
        assert!(big
            .chunks(100_000)
            .enumerate()
            .all(|(k, c)| c.iter().all(|&b| b == k as u8)));
        let (lo, hi) = (23 * r / n, 23 * (r + 1) / n);
        let want: Vec<i64> = (lo..hi)
            .map(|i| (i * (1..=n).sum::<usize>()) as i64)
            .collect();
        assert_eq!(rs, &want, "rank {r} reduce-scatter");
    }
}

#[test]
fn uneven_byte_count_is_refused() {
    let out = run(2, |c| {
        let mut b = vec![0u8; 7];
        c.allreduce_bytes(&mut b, DataType::I32, ReduceOp::Sum)
            .err()
            .map(|e| e.kind())
    });
    assert!(out
        .iter()
        .all(|k| *k == Some(fabric::ErrorKind::InvalidArgument)));
}

/// Recursive doubling reduces each received segment as it is read out (several segments
/// per step here), and the write ring reduces landed segments in 32 KiB pieces straight
/// into its send buffer: on 5 and 6 ranks (folded groups), with counts that do not divide
/// by the group or the segment, every rank holds the same bits and the integer results
/// are exact.
#[test]
fn segmented_reductions_on_odd_groups_and_counts() {
    for n in [5usize, 6] {
        let cfg = CommConfig {
            segment: 8192,
            eager_pieces_max: 0,
            write_segment: 40_000,
            write_window: 4,
            ..CommConfig::default()
        };
        let counts = [1usize, 7, 3_001, 16_385, 100_003];
        let out = run_with(n, cfg, move |c| {
            let mut res = Vec::new();
            for &count in &counts {
                let mut f: Vec<f32> = (0..count)
                    .map(|i| ((c.rank() + 1) as f32).powi(7) * 1.000_1f32.powi(i as i32 % 50) / 3.0)
                    .collect();
                c.allreduce(&mut f, ReduceOp::Sum).unwrap();
                let mut v: Vec<i64> = (0..count).map(|i| value(c.rank(), i)).collect();
                c.allreduce(&mut v, ReduceOp::Sum).unwrap();
                res.push((f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), v));
            }
            res
        });
        for (k, &count) in counts.iter().enumerate() {
            for r in 1..n {
                assert_eq!(out[r][k].0, out[0][k].0, "n {n} count {count}: bits differ");
            }
            for (i, x) in out[0][k].1.iter().enumerate() {
                let want: i64 = (0..n).map(|r| value(r, i)).sum();
                assert_eq!(*x, want, "n {n} count {count} [{i}]");
            }
        }
    }
}

/// Small payloads on power-of-two groups gather every rank's data and fold it in rank
/// order, taking the rounds in alternating order from call to call: the bits are those of
/// the left fold `((v0 op v1) op v2) ...` on every rank and in every call, also when the
/// messages are cut into 8-byte segments that cross the ranks' blocks (3- and 5-byte u8
/// payloads) and for a payload just over the threshold (recursive doubling).
#[test]
fn gathered_small_allreduce_is_the_rank_order_fold_in_every_call() {
    for n in [2usize, 4, 8] {
        for segment in [8usize, 8192] {
            let cfg = CommConfig {
                segment,
                eager_pieces_max: 0,
                gather_max: 64,
                ..CommConfig::default()
            };
            let counts = [1usize, 3, 5, 16];
            let out = run_with(n, cfg, move |c| {
                let mut res = Vec::new();
                for &count in &counts {
                    // Three calls in a row: both orders of the rounds, then the first again.
                    for _ in 0..3 {
                        let mut f = floats(c.rank(), count, 0);
                        c.allreduce(&mut f, ReduceOp::Sum).unwrap();
                        let mut u: Vec<u8> = (0..count).map(|i| value(c.rank(), i) as u8).collect();
                        c.allreduce(&mut u, ReduceOp::Max).unwrap();
                        res.push((f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), u));
                    }
                }
                // Over the threshold (64 bytes): recursive doubling, still right.
                let mut v: Vec<i64> = (0..9).map(|i| value(c.rank(), i)).collect();
                c.allreduce(&mut v, ReduceOp::Sum).unwrap();
                (res, v)
            });
            for (k, &count) in counts.iter().flat_map(|c| [c; 3]).enumerate() {
                let want: Vec<u32> = (0..count)
                    .map(|i| {
                        let mut acc = floats(0, count, 0)[i];
                        for r in 1..n {
                            acc += floats(r, count, 0)[i];
                        }
                        acc.to_bits()
                    })
                    .collect();
                let want_u: Vec<u8> = (0..count)
                    .map(|i| (0..n).map(|r| value(r, i) as u8).max().unwrap())
                    .collect();
                for (r, (res, _)) in out.iter().enumerate() {
                    assert_eq!(res[k].0, want, "n {n} seg {segment} count {count} rank {r}");
                    assert_eq!(
                        res[k].1, want_u,
                        "n {n} seg {segment} count {count} rank {r}"
                    );
                }
            }
            for (_, v) in &out {
                for (i, x) in v.iter().enumerate() {
                    assert_eq!(*x, (0..n).map(|r| value(r, i)).sum::<i64>(), "n {n} [{i}]");
                }
            }
        }
    }
}
