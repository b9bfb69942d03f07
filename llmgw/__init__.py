"""llmgw: self-hosted LLMs on a small fleet, behind one OpenAI-compatible endpoint.

The project's apps (`agents`, `cluster`, `gateway`, `dashboard`, and `ground` below them) are top-level packages
in the repository. An installed llmgw keeps them inside this package (`llmgw/apps/`, see pyproject.toml), where
they collide with no other distribution's top-level packages (`openai-agents` installs an `agents` too); every
llmgw process starts by importing this package, which puts that directory (or the checkout) first on its path.
"""

import importlib.util
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
for _root in (_here / "apps", _here.parent):  # installed; a checkout (run from any directory)
    if (_root / "cluster" / "__init__.py").is_file():
        # first, even where it is on the path already: before the directory a program runs from, which Python
        # puts there (`python -m …`), and which may hold an `agents.py` of its own
        while str(_root) in sys.path:
            sys.path.remove(str(_root))
        sys.path.insert(0, str(_root))
        break

# The control plane's Celery app, where the control plane is installed (`llmgw[server]`): loaded with Django, so
# every task is sent through it. A node's install (the agent alone) has no Celery.
if importlib.util.find_spec("celery") is not None:
    from .celery import app as celery_app
else:
    celery_app = None

__all__ = ["celery_app"]
