"""Is a transformed module still the same function, and if not, where not?

Each check runs the model (or a keyed copy) under controlled conditions and
names nodes by key and the user's ``file:line``::

    check_equivalence(reference, candidate, *inputs)     equivalence.py
      ├─ ControlledRuns                                 controlled_run.py
      ├─ compare_values(outputs)                        compare.py
      └─ localize: Capture("all") on both, match_nodes  node_matching.py
           (grads=True: activation_grads, in backward order)  activation_grads.py
         the report and its tables                      equivalence_report.py
    vjp(model, *inputs, output=, wrt=)             vector_jacobian.py } node_by_node.py: values
    jacobian_norms(model, *inputs)                 jacobian.py        } with their autograd graph

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> fxdebug.equivalence.check_equivalence(model, fxdebug.trace(model), torch.randn(3, 2)).ok
True
"""

from .compare import Comparison, compare_tensors, compare_values
from .equivalence import EquivalenceReport, NodeComparison, check_equivalence
from .jacobian import JacobianNorms, jacobian_norms
from .vector_jacobian import vjp

__all__ = ["check_equivalence", "EquivalenceReport", "NodeComparison", "vjp", "jacobian_norms",
           "JacobianNorms", "Comparison", "compare_tensors", "compare_values"]
