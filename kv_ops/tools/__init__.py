"""kv_ops.tools: what a user runs around the ops, not inside a model's step.

* ``aot``    -- ``compile_step`` / ``load_step``: AOT-compiling a model's step that uses these ops
                (``kv_ops`` and ``ple_ops`` alike).
* ``doctor`` -- ``python -m kv_ops.tools.doctor``: checks a machine for both packages, measures the link.
"""
