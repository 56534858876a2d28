"""The compile report under its first name: what a compiled step costs (`jaxpar/compile_report.py`) and a config's
step compiled for it (`for_config`, which is `jaxpar.compiled.report_for`)."""
from jaxpar.compile_report import (compile_report, format_table, memory_bytes,  # noqa: F401
                                   state_group_bytes)
from jaxpar.compiled import report_for as for_config  # noqa: F401
