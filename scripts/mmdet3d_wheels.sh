#!/usr/bin/env bash
# The wheel kit for mmdet3d 1.4 on mmcv-lite (tests/compat, model_examples/_mmdet3d_run.py) on the
# GPU machine, which has no package index: exactly the packages its image lacks, for CPython 3.12
# on x86-64 (manylinux or pure-Python wheels), each without its dependencies, into
# .peers/mmdet3d-wheels/ (ignored by git: /.peers/ in .git/info/exclude). Run here, where pip
# reaches an index; carry .peers/mmdet3d-wheels and install there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#     .peers/mmdet3d-wheels/*.whl          (scripts/mmdet3d_gpu_session.sh does it)
#
# The list: the four OpenMMLab packages (their own pins would pull the compiled mmcv and
# numpy < 2: README, "Using muSPACE with mmdet3d") and the imports they make on the way to
# building, training and running PointPillars / CenterPoint that the image lacks (its package list:
# the device notes' "Python packages already there", which has numpy, torch, scipy, numba,
# matplotlib, opencv-python-headless, rich, pyyaml, six, tqdm, packaging, pillow ...). The versions
# are those tests/compat ran with here. Nothing in the image is downloaded again.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DEST=.peers/mmdet3d-wheels
WHEELS=(
  mmengine==0.10.7 mmcv-lite==2.1.0 mmdet==3.3.0 mmdet3d==1.4.0
  # the first importer of each, seen here on `import mmdet3d.models`:
  addict==2.4.0          # mmengine.config.config
  yapf==0.43.0           # mmengine.config.config
  platformdirs==4.14.9   # yapf (yapf_third_party._ylib2to3)
  termcolor==3.3.0       # mmengine.logging.logger
  terminaltables==3.1.10 # mmdet.evaluation.functional.mean_ap
  shapely==2.2.0         # mmdet.structures.mask.structures
  pycocotools==2.0.11    # mmdet.structures.mask.structures
)
if ! git check-ignore -q "$DEST/probe.whl"; then
  echo "$DEST is not ignored by git: add /.peers/ to $(git rev-parse --git-common-dir)/info/exclude" >&2
  exit 1
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mmdet3d-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d "$tmp" "${WHEELS[@]}"
n=$(find "$tmp" -name '*.whl' | wc -l)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels, got $n:" >&2
  ls -1 "$tmp" >&2
  exit 1
fi
rm -rf "$DEST" # one version of each: two of one package stop the whole install there
mkdir -p "$(dirname "$DEST")"
mv "$tmp" "$DEST"
trap - EXIT
ls -1 "$DEST"
kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: $n wheels, $((kib / 1024)) MiB ($kib KiB)"
if [ "$kib" -gt $((30 * 1024)) ]; then
  echo "over the 30 MiB this kit may take of a device call's 64 MiB" >&2
  exit 1
fi
