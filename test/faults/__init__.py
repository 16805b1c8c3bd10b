"""The fault suite: a run killed or its files damaged, then resumed or refused.

These tests cut across the package (a checkpoint folder, ``SameStartGroups``, ``MCAdvantage``,
the examples' loops) rather than mirror one module, so they live in their own folder; each ends
in a refused load that names the cause, or in a resumed run whose trained groups are the
uninterrupted run's. The loop they kill is ``test/helpers/faults.py``; docs/resume.rst lists
the faults and what happens.
"""
