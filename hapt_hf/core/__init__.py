"""Facts every side of hapt_hf shares, each written once: torch-free, imported from everywhere.

* :mod:`~hapt_hf.core.layers`: the layer sequence (embedding, blocks or block halves, head),
  its length in each unit, index <-> block/half and the names the tables print;
* :mod:`~hapt_hf.core.schedules`: the schedule kinds, their warm-up rules and the one
  generator of per-stage action lists;
* :mod:`~hapt_hf.core.precision`: the training dtypes and their sizes;
* :mod:`~hapt_hf.core.families`: the model families hapt_hf can describe and cut;
* :mod:`~hapt_hf.core.tp`: the tensor-parallel degrees a model's sizes allow;
* :mod:`~hapt_hf.core.ranks`: how global ranks are numbered over a cluster's groups;
* :mod:`~hapt_hf.core.defaults`: defaults several layers agree on (bucket size, timeout);
* :mod:`~hapt_hf.core.data`: where the package's data files (clusters, profiles) live.

Nothing here imports anything of hapt_hf but :mod:`hapt_hf.errors`.
"""
