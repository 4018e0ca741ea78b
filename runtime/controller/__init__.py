"""The controller: one process per run (DESIGN.md §2).

``python -m runtime.controller --run-dir D`` is the process (``__main__.py``); it is started by
``runtime.launcher.spawn_controller`` and nothing else. The run directory must hold the resolved
``config.yaml``. ``core.py`` makes every decision (sans-IO), ``process.py`` is the process
around it (sockets, children, the event loop); ``governor.py`` holds the lag rules,
``ledger.py`` the group ledger and ``client.py`` the clients of a running controller.
"""
