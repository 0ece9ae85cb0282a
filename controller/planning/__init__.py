"""The pure decision core of the control plane: what a service is (``model``), what the
planner decides (``actions``), the rules (``planner``, with ``steps`` for staged rollouts,
``analysis`` for a canary's window and ``autoscaler`` for the desired count) and how a
service's state changes (``transitions``).

Every module here is PURE: no I/O, no clock, no task; the import-linter contract "Pure modules
import no I/O module" holds the whole package to it. The reconciler (``controller.reconciler``)
drives it; the executor performs what it decides.
"""
