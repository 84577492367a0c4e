"""Tools of the repository, not of the product: they are not installed with vexact (pyproject.toml lists only the
``vexact`` packages and ``vexact_kernels``), and run from a checkout's root, as ``python -m tools.NAME``:

* ``docs_gen``: the documentation's generated reference regions (``python -m tools.docs_gen --update`` /
  ``--check``) and the mkdocs hook that refreshes them (``hooks:`` in ``mkdocs.yml``);
* ``published``: the tables of docs/results/published_runs.md, from ``published_runs.yaml`` and the shipped map;
* ``studies``: one-off studies a results page names (``python -m tools.studies.NAME``).

They import vexact like any user; no module of vexact imports them (``tests/repo/test_layout.py``).
"""
