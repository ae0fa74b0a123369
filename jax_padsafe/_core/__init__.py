"""What every backend shares: argument checks, the static options (``spec``), the canonical
problem, the visibility rule, the ``Backend`` type and the ``custom_vjp``, and the layers' common
logic. Nothing here knows a backend."""
