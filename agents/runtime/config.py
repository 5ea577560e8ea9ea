"""One check for every agent config: types, bounds and choices, each failure naming the field.

It lives in :mod:`tokengym.rewards.common` (the lowest package, whose configs use it too).
"""

from tokengym.rewards.common import check_config

__all__ = ["check_config"]
