set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_wheels/*.whl
# dev-only: top_kernels keeps 400 operators instead of 20 (so the categories cover the whole step)
cat > /tmp/site/sitecustomize.py <<'PY'
import importlib.abc, importlib.util, os, sys

class _WidenTopKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "gem_ops.train.mfu_window":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.top_device_operators.__defaults__ = (400,)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _WidenTopKernels())
here = os.path.dirname(os.path.abspath(__file__))
for entry in sys.path:
    candidate = os.path.join(entry or ".", "sitecustomize.py")
    if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
        exec(compile(open(candidate).read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
        break
PY
export PYTHONPATH=/tmp/site:$PWD GEM_SOURCE_COMMIT=$1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache TRITON_CACHE_DIR=$PWD/.triton_cache
shift
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv || true
set -o pipefail
python3 -m benchmarks.mfu --device cuda --data .gpu_data/mfu --preset gem_gpu --skip-dense --shapes preset "w0.5_L512:width=0.5,max_history_len=512" --precisions bf16@model --steps 20 --warmup-steps 10 --profile-steps 3 --repeats 1 --copy-to $OUT --time-budget 520 --output-name mfu_cuda_kernel_breakdown "$@" 2>&1 | tee $OUT/log.txt
