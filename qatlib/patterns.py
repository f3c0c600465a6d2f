"""The ``ignore_layers`` pattern rule: which module names a user's pattern selects.

Torch-free on purpose: the quantizer placement (`qatlib.quant.linear`), the runtime's resolved
``ignore`` list (`qatlib.runtime.ignore`) and the torch-free memory plan (`qatlib.plan`, also read
by the Snakefile) all decide with this one function.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Does the module ``name`` match one of the user's ``ignore_layers`` patterns?

    A pattern matches whole dotted components at the end of the name (``lm_head``, ``mlp.gate``,
    upstream's ``gate.weight`` with its ``.weight`` dropped) or, with a ``re:`` prefix, as a full
    regular expression (compressed-tensors' convention). ``gate`` never matches ``gate_proj``, the
    substring bug that made the upstream toolkit skip every expert gate projection.
    """
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
            continue
        p = p.removesuffix(".weight").removesuffix(".bias")
        if name == p or name.endswith("." + p):
            return True
    return False
