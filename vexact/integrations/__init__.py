"""Hooks that put ``vexact.live.LiveMonitor`` inside other trainers: ``trl`` (a ``GRPOTrainer`` mixin) and ``verl``
(the batch a ``RayPPOTrainer`` step holds). Each module imports its framework only when used."""
