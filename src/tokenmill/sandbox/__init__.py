"""A sandbox for model-written code: limits, namespaces, and a kill that takes the whole process tree.

>>> sandbox = Sandbox()                      # "bwrap" or "unshare"; SandboxUnavailable if neither works
>>> sandbox.run_python("print(input()[::-1])", stdin="abc").stdout
'cba\\n'
"""

from tokenmill.sandbox.limits import Limits, RunResult, SandboxUnavailable
from tokenmill.sandbox.runner import ISOLATIONS, Sandbox, available_isolation

__all__ = ["ISOLATIONS", "Limits", "RunResult", "Sandbox", "SandboxUnavailable", "available_isolation"]
