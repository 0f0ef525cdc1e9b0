"""Reports: one function per Plotly figure and one self-contained HTML assembler (``coplan report``).

- :mod:`.inputs`: load a plan, a run directory and a calibration; re-price the plan with the cost model
  (keeping its two-stream schedule) where a figure needs more than the stored Prediction.
- :mod:`.ledger`: the step's wall time split into model FLOPs at peak and losses that add up exactly.
- Figures: :mod:`.waterfall` (MFU waterfall), :mod:`.timeline` (predicted step Gantt), :mod:`.ranks`
  (per-rank time and memory), :mod:`.sharding` (embedding sharding map), :mod:`.balance` (jagged
  balance), :mod:`.scaling` (``coplan simulate`` curve), :mod:`.runs` (measured vs predicted),
  :mod:`.calibration` (predicted vs measured per op).
- :mod:`.palette` (the one colour table), :mod:`.layout` (shared layout, unit formatting),
  :mod:`.summary` (the text at the top), :mod:`.html` (the page), :mod:`.plotlyjs` (which plotly.js
  bundle the page embeds: the vendored basic one, ``vendor/``, or the full one), :mod:`.build` (assembly),
  :mod:`.cli` (the verb).

Reports import :mod:`coplan.spec` and :mod:`coplan.costmodel`, never torch, the planner or the trainer;
the verb hands the planner's ``simulate_point`` to the scaling curve.
"""
