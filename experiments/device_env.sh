# Set-up shared by the prepared device runs (sourced): installs the carried wheels, points
# PYTHONPATH and ../shared/data at the carried tree, records the chip in $OUT/gpu.txt and
# defines step NAME CMD... (output appended to $OUT/log.txt, its tail shown).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p ../shared && ln -sfn "$PWD/.gpu/data" ../shared/data
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax, orbax.checkpoint as oc, torch, transformers as t; \
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, \
'transformers', t.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
step() { echo "=== $1 ($(date +%T))"; shift; "$@" 2>&1 | tee -a "$OUT/log.txt" | grep -vE "Warning|warn\(" | tail -12; }
# per_op HLO_DIR TRACE STEPS [ARCHIVE]: the dumped optimised programs to ARCHIVE (default
# $OUT/<TRACE's folder name>.hlo.tgz; kept if already written) and the trace's kernel time per model op to
# ops.json beside TRACE (experiments/gpu_trace_ops.py: of several programs, the one naming the trace's kernels)
per_op() {
  local dir tgz; dir=$(dirname "$2"); tgz=${4:-$OUT/$(basename "$dir").hlo.tgz}
  [ -e "$tgz" ] || (cd "$1" && tar czf "$tgz" $(ls | grep -E 'after_optimizations\.txt$'))
  python3 experiments/gpu_trace_ops.py "$2" "$1" --steps "$3" --top 40 --out "$dir/ops.json"
}
