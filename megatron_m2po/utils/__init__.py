"""What every package uses and none owns: config-section machinery (``settings.py``), one-line
user errors (``errors.py``), logging, metrics sinks and progress (``logging.py``), phase timings
and traces (``timing.py``), children that die with the trainer (``lifeline.py``, ``reaper.py``),
fault points for the kill tests (``faults.py``), network helpers, pinned host buffers, HF
directories, lazy package names, a background event loop, and the one seam to the CPU stand-ins
(``standin.py``).
"""
