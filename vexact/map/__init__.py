"""The collapse map: where a run's mismatch k3 sits against the collapse threshold at its horizon, per correction.

``naming`` (which curve a run is on: its correction from vexact / verl / TRL spellings, its mismatch source) ->
``points`` (a sweep's runs as map points) -> ``shapes`` and ``fit`` (per horizon a dose-response threshold; over the
horizons the power law, its interval, the saturating shape) -> ``verdict`` (the map file and a user's place on it:
``compare --map``, ``vexact.live``) -> ``scaling_report`` (a sweep report's scaling.json) -> ``build`` (a map from
sweeps and scaling.json files; ``python -m vexact.map``). ``default_map.json`` and ``default_tail_map.json`` are the
maps vexact ships. Imports ``vexact.sweeps`` and below.
"""
