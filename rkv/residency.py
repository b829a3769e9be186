"""``rkv.residency``: the planner's former single module, kept as a re-export of
:mod:`rkv.planner` (every public name of its modules) so existing imports keep working.
New code imports :mod:`rkv.planner`.
"""

from rkv.planner import *  # noqa: F401,F403
from rkv.planner import __all__  # noqa: F401
