"""Makes `python exNN_*.py` use the fsdp_lab of this checkout when run from it (else the installed one).

The checks themselves live in the package: fsdp_lab.lessons.exercises (the runner, and the checks only the
exercises use) and fsdp_lab.lessons.live.checks (the checks the notebooks' "Your turn" cells run on live ranks).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "fsdp_lab" / "__init__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
