"""mmdet3d 1.4's own CenterPoint config on mmcv-lite with muSPACE serving mmcv._ext: native vs
reference losses and gradients, a 50-step training run, training-step and predict times
(model_examples/_mmdet3d_run.py with --model centerpoint; its docstring says what each stage does).

    PYTHONPATH=$PWD MUSPACE_TRY_UNVERIFIED=1 python model_examples/CenterPoint/scripts/centerpoint_mmdet3d.py
    PYTHONPATH=$PWD python model_examples/CenterPoint/scripts/centerpoint_mmdet3d.py --smoke   # CPU check
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _mmdet3d_run  # noqa: E402

if __name__ == "__main__":
    sys.exit(_mmdet3d_run.main(model="centerpoint"))
