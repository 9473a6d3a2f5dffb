"""Device meshes as data (`mesh_lib`: a role's mesh is `[(axis, size)]`) and the
logical-axis rule tables that place parameters on them (`rules`: the
learner's fsdp + tp, the sampler's tp).

Layer 1: may import `core` only.
"""
