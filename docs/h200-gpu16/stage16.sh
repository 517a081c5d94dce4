#!/usr/bin/env bash
# gpu16: fill the folders the device calls carry (in REPO, default /work/main: the device
# is sent the session's checkout, where `.gpu*/` is ignored):
#   .gpu16a  GGUF part 1 (call 1, beside .gpu1)
#   .gpu16b  MLX's CUDA build, second half, and the wheels the bench needs (.gpu2's, less
#            hypothesis and pytest_trio: room for more of the GGUF), install16.sh, GGUF part 2
#   .gpu16c  GGUF part 3 (the first call that runs the real model)
#   .gpu16   these scripts, build_model.py (docs/h200-gpu9), src.tar.xz (kvtrio at REV),
#            the GGUF's sha256
# The GGUF travels xz-compressed (98,362,432 bytes -> about 90.4 MB) in three parts: a call
# carries at most 64 MiB, the checkout (about 9.5 MB) included.
# Usage: stage16.sh GGUF [P1_BYTES P2_BYTES]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=${REPO:-/work/main}; gguf=$1; p1=${2:-16000000}; p2=${3:-19000000}
cd "$repo"
rm -rf .gpu16 .gpu16a .gpu16b .gpu16c && mkdir -p .gpu16 .gpu16a .gpu16b .gpu16c
xz=${XZ_CACHE:-/tmp/g16-gguf.xz}
[ -s "$xz" ] || xz -9e -T2 -c "$gguf" > "$xz"
dd if="$xz" of=.gpu16a/gguf.xz.1 bs=1M iflag=count_bytes count="$p1" status=none
dd if="$xz" of=.gpu16b/gguf.xz.2 bs=1M iflag=skip_bytes,count_bytes skip="$p1" count="$p2" status=none
tail -c +$(( p1 + p2 + 1 )) "$xz" > .gpu16c/gguf.xz.3
cat .gpu16a/gguf.xz.1 .gpu16b/gguf.xz.2 .gpu16c/gguf.xz.3 | cmp - "$xz"
sha256sum "$gguf" | cut -d' ' -f1 > .gpu16/gguf.sha256
echo "$(basename "$gguf")" > .gpu16/gguf.name
cp .gpu2/part.rest .gpu16b/
for w in mlx_lm trio outcome sniffio; do cp .gpu2/$w-*.whl .gpu16b/; done
cp "$here/install16.sh" .gpu16b/
# kvtrio itself: a git archive of the commit (REF, default HEAD) without docs/ and tests/, xz'd:
# the checkout that travels may hold uncommitted edits.
git archive "${REF:-HEAD}" -- . ':!docs' ':!tests' | xz -9 > .gpu16/src.tar.xz
git rev-parse --short "${REF:-HEAD}" > .gpu16/REV
git show "${REF:-HEAD}":docs/h200-gpu9/build_model.py > .gpu16/build_model.py
cp "$here"/*.py "$here"/*.sh .gpu16/
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
for c in ".gpu1 .gpu16a" ".gpu16b .gpu16" ".gpu16c .gpu16"; do
  n=$(( tree + $(du -cb $c | tail -1 | cut -f1) ))
  echo "carry $c: $n bytes with the checkout (limit 67108864, margin $(( 67108864 - n )))"
done
cat .gpu16/REV .gpu16/gguf.sha256
