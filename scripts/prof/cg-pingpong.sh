#!/usr/bin/env bash
# cg-pingpong.sh: callgrind profiles of the clients of ours and perftest's 8-byte
# ping-pongs on siw0, each at two iteration counts, for `cg-instr.py --whole` (their
# difference is one iteration's cost, start-up and connection set-up left out). The
# servers run natively. Inside the soft-RDMA guest:
#
#   scripts/soft-rdma run --rwdir DIR -- scripts/prof/cg-pingpong.sh DIR [OP...]
#   scripts/prof/cg-instr.py DIR/ours-send-2000.out DIR/ours-send-6000.out --iters 4000 \
#       --whole --exclude 'sort|rnr_main|retry_blocked|poll_emu|Condvar|lock_slow|retain'
#
# OP: send and write by default (transmit complete, as perftest measures), or read.
# Ours runs with --spin and --server-polls, as scripts/bench's latency rows; perftest
# with -R (rdma_cm), as there. Needs valgrind and a release build of `fabric`.
set -euo pipefail
out=${1:?usage: cg-pingpong.sh DIR [OP...]}
shift
ops=("$@")
[ ${#ops[@]} -gt 0 ] || ops=(send write)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
fabric=${FABRIC:-$root/target/release/fabric}
[ -x "$fabric" ] || { echo "cg-pingpong.sh: no $fabric (cargo build --release -p fabric-cli)" >&2; exit 2; }
command -v valgrind > /dev/null || { echo "cg-pingpong.sh: valgrind is not installed" >&2; exit 2; }
siw=$(ip -4 -o addr show dev dummy1 2>/dev/null | awk '{print $4}' | cut -d/ -f1 || true)
[ -n "$siw" ] || { echo "cg-pingpong.sh: no address on dummy1: run inside scripts/soft-rdma" >&2; exit 2; }
mkdir -p "$out"
port=$((7600 + RANDOM % 1000))
cg() { valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$1" "${@:2}"; }
for n in 2000 6000; do
    for op in "${ops[@]}"; do
        tc=()
        [ "$op" = read ] || tc=(--completion transmit)
        "$fabric" perf lat --op "$op" --size 8 --provider iwarp --role server --listen "$siw:0" \
            > "$out/ours-$op-$n.server" 2>&1 &
        spid=$!
        for _ in $(seq 100); do
            grep -q "^listening on " "$out/ours-$op-$n.server" 2>/dev/null && break
            sleep 0.1
        done
        addr=$(sed -n 's/^listening on //p' "$out/ours-$op-$n.server" | head -1)
        cg "$out/ours-$op-$n.out" "$fabric" perf lat --op "$op" --size 8 --iters "$n" \
            --warmup 100 --spin --server-polls "${tc[@]}" --provider iwarp --role client \
            --connect "$addr" > "$out/ours-$op-$n.txt" 2>&1 || echo "cg-pingpong.sh: ours $op $n failed" >&2
        kill -INT "$spid" 2>/dev/null || true
        wait "$spid" 2>/dev/null || true
        port=$((port + 1))
        timeout 900 "ib_${op}_lat" -d siw0 -R -s 8 -n "$n" -p "$port" > "$out/pt-$op-$n.server" 2>&1 &
        spid=$!
        sleep 2
        cg "$out/pt-$op-$n.out" "ib_${op}_lat" -d siw0 -R -s 8 -n "$n" -p "$port" "$siw" \
            > "$out/pt-$op-$n.txt" 2>&1 || echo "cg-pingpong.sh: ib_${op}_lat $n failed" >&2
        wait "$spid" 2>/dev/null || true
        echo "cg-pingpong.sh: $op, $n iterations: $out/ours-$op-$n.out, $out/pt-$op-$n.out"
    done
done
