#!/usr/bin/env bash
# gpushare on a machine with an NVIDIA GPU, in one go and without network: install it from
# this checkout into the Python that has PyTorch, then run the GPU test tier and the GPU
# benchmarks, writing their JSON and logs to OUTDIR (docs/benchmarks.md, "On an NVIDIA GPU").
#
#   benchmarks/gpu_lease.sh OUTDIR [WHEELS]
#
# PYTHON: the Python with PyTorch (default python3). WHEELS: a folder of wheels of what that
# Python lacks and gpushare needs (cffi, pycparser, pyzmq), installed with --no-index
# (default: .whl in the checkout; none: nothing installed). GPU_LEASE_STEPS: which of the
# steps after the install run, in their order here (default: all of them: tests-gpu
# bench-gpu-qos bench-gpu-timeslice bench-gpu-predict bench-gpu). Each step runs under a
# time limit, and all of
# them within GPU_LEASE_BUDGET seconds (default 600); one that fails or times out is
# recorded in OUTDIR/steps.txt and the next one still runs (one with under 20 s of the
# budget left is skipped). Exit status: 0 when every step passed, else 1 (2: a step named
# in GPU_LEASE_STEPS that does not exist). About 10 minutes on an H200.
set -u

if [ $# -lt 1 ]; then
	echo "usage: $0 OUTDIR [WHEELS]" >&2
	exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${2:-$ROOT/.whl}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 # a step stopped at its time limit still leaves all it printed
STEPS=$OUT/steps.txt
BUDGET=${GPU_LEASE_BUDGET:-600}
ALL_STEPS="tests-gpu bench-gpu-qos bench-gpu-timeslice bench-gpu-predict bench-gpu"
STEPS_WANTED=" ${GPU_LEASE_STEPS:-$ALL_STEPS} "
for name in $STEPS_WANTED; do
	case " $ALL_STEPS " in
	*" $name "*) ;;
	*)
		echo "GPU_LEASE_STEPS: no step $name (the steps: $ALL_STEPS)" >&2
		exit 2
		;;
	esac
done
BEGAN=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpulease-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT" || exit 2
: >"$STEPS"
failed=0

# step NAME LOG SECONDS COMMAND...: run COMMAND with a time limit (SECONDS, or what is left
# of the budget if less), its output appended to LOG; one line in steps.txt: the name, the
# exit status (124: timed out), the seconds taken.
step() {
	local name=$1 log=$2 limit=$3 start rc left
	shift 3
	case $name in
	wheels | build | install) ;;
	*) [[ $STEPS_WANTED == *" $name "* ]] || return 0 ;;
	esac
	start=$(date +%s)
	left=$((BUDGET - (start - BEGAN)))
	if [ "$left" -lt 20 ]; then
		echo "$name skipped: ${left}s of the ${BUDGET}s budget left" | tee -a "$STEPS" "$log"
		failed=1
		return 1
	fi
	[ "$limit" -le "$left" ] || limit=$left
	echo "=== $name: $* (limit ${limit}s)" >>"$log"
	timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
	rc=$?
	echo "$name rc=$rc seconds=$(($(date +%s) - start))" | tee -a "$STEPS"
	[ "$rc" -eq 0 ] || failed=1
	return "$rc"
}

SETUP=$OUT/setup.log
{
	date -u
	echo "checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
	uname -a
	nproc
	nvidia-smi || true
	nvidia-smi -q -d CLOCK,PERFORMANCE,TEMPERATURE,POWER || true
	"$PY" -c 'import sys, torch; print(sys.executable, sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' || true
} >"$SETUP" 2>&1

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
	step wheels "$SETUP" 120 "$PY" -m pip install --no-index --no-deps --no-cache-dir "$WHEELS"/*.whl
else
	echo "wheels: none in $WHEELS" | tee -a "$STEPS" "$SETUP"
fi
# gpushare as a user installs it beside their framework: built from this checkout, into
# PYTHON's environment (so gpushare-run, nodemgr and the start-up hook sit beside torch).
if step build "$SETUP" 300 "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$WORK/wheel" .; then
	step install "$SETUP" 120 sh -c '"$1" -m pip install --no-index --no-deps --force-reinstall --no-cache-dir "$2"/gpushare-*.whl' \
		sh "$PY" "$WORK/wheel"
else
	echo "install skipped: no gpushare wheel was built" | tee -a "$STEPS" "$SETUP"
	failed=1
fi
"$PY" -m pip list 2>/dev/null | grep -i -E '^(gpushare|torch|cffi|pycparser|pyzmq|msgpack|click|prometheus.client|nvidia-ml-py|pytest) ' >>"$SETUP"

# The GPU test tier (tests/gpu: about a minute and a half on an H200), with what each test
# printed (the figures it compared).
step tests-gpu "$OUT/tests-gpu.log" 240 env GPUSHARE_TEST_TORCH_PYTHON="$PY" \
	"$PY" -m pytest -p no:cacheprovider -m gpu tests/gpu -v -rA

# Latency classes and compute shares (about 4 minutes): --quick, shorter runs.
step bench-gpu-qos "$OUT/gpu_qos.log" 300 "$PY" benchmarks/qos_bench.py --gpu --quick \
	--python "$PY" --out "$OUT/gpu_qos.json"

# Two training loops time-sliced (about 1.5 minutes): --quick, 12 iterations a job.
step bench-gpu-timeslice "$OUT/gpu_timeslice.log" 180 "$PY" benchmarks/gpu_timeslice_bench.py \
	--quick --out "$OUT/gpu_timeslice.json"

# Prediction (about 2.5 minutes): --quick, the zoo's 20 configurations, dry runs on the
# simulated driver against real runs on the GPU.
step bench-gpu-predict "$OUT/gpu_predict.log" 240 "$PY" benchmarks/predict_bench.py --gpu \
	--quick --python "$PY" --out "$OUT/gpu_predict.json"

# What the shim costs a PyTorch program: 8 interleaved pairs of runs (about 3.5 minutes).
# Last: stopped at the end of the budget, it still writes the runs that ended.
step bench-gpu "$OUT/gpu.log" 330 "$PY" benchmarks/gpu_bench.py --python "$PY" --out "$OUT/gpu.json"

# One line per benchmark: met or missed, and the figure its target is about.
for pair in bench-gpu-qos:gpu_qos bench-gpu-timeslice:gpu_timeslice bench-gpu-predict:gpu_predict bench-gpu:gpu; do
	doc=$OUT/${pair#*:}.json
	# Only of a step that ran now: OUTDIR may hold an earlier run's documents.
	[[ $STEPS_WANTED == *" ${pair%%:*} "* ]] && [ -s "$doc" ] || continue
	"$PY" - "$doc" <<'EOF' | tee -a "$STEPS"
import json, sys
sys.path.append(".")
from benchmarks import harness
doc = json.load(open(sys.argv[1]))
for name, result in doc["benchmarks"].items():
    print(f"{name}: {harness.verdict(result)}")
EOF
done
exit "$failed"
