set -x
nvidia-smi --query-gpu=name,driver_version --format=csv
python -c "import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda)"
pip list 2>/dev/null | grep -i -E "scikit|pybind|pytest|numpy|ninja|cmake|torch"
ls /usr/include/dlpack 2>&1; TI=$(python -c "import torch,os;print(os.path.join(os.path.dirname(torch.__file__),'include'))"); ls $TI/dlpack 2>&1; grep -n "define DLPACK_VERSION\|DLPACK_MAJOR" $TI/dlpack/dlpack.h $TI/ATen/dlpack.h 2>&1 | head
HINT=""; [ -f /usr/include/dlpack/dlpack.h ] || HINT="-DTESSERA_DLPACK_HINTS=$TI"
time cmake -S . -B build -G Ninja -DTESSERA_BUILD_BENCH=OFF -DTESSERA_BUILD_TESTS=OFF $HINT > $OUT/cmake.log 2>&1; tail -5 $OUT/cmake.log
time cmake --build build -j16 --target _C > $OUT/build.log 2>&1; echo build rc=$?; tail -5 $OUT/build.log
timeout 300 python -m pytest -q -rs tests/python > $OUT/pytest.log 2>&1; echo pytest rc=$?; tail -60 $OUT/pytest.log
