# gpu16's second device call (source it): .gpu2/install.sh from .gpu16b (MLX's CUDA build
# into $HOME/site, the bench's wheels), and GGUF part 2 parked in $HOME/g16.
if [ ! -f $HOME/stage/part.aa ]; then
  echo "no $HOME/stage/part.aa: the machine was not warm; make the first call again" >&2
  return 1 2>/dev/null || exit 1
fi
mkdir -p $HOME/site $HOME/g16 && cp .gpu16b/gguf.xz.2 $HOME/g16/
cat $HOME/stage/part.aa .gpu16b/part.rest | xz -d | tar x -C $HOME/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .gpu16b/*.whl
sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
ln -sfn "$sp/nvidia" $HOME/site/nvidia
export PYTHONPATH=$HOME/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
