"""The controller: one process per run (DESIGN.md §2).

``python -m runtime.controller --run-dir D`` is the process (``__main__.py``); it is started by
``runtime.launcher.spawn_controller`` and nothing else. The run directory must hold the resolved
``config.yaml``. See ``server.py`` for the wiring, ``governor.py`` for the lag rules,
``ledger.py`` for the group ledger and ``client.py`` for talking to a running controller.
"""
