"""What the tests share, by topic: a test module imports its helpers from here, never from
another test module (``tests/test_test_layout.py`` checks it). Fixtures stay in
``tests/conftest.py``, which pytest shares on its own.

- :mod:`tests.support.lanes`: the lanes and links every transport and PS test runs over
- :mod:`tests.support.host`: another user, planted objects, ``/dev/shm`` files, the C kernel
- :mod:`tests.support.logs`: waits and checks on what was logged
- :mod:`tests.support.models`: small real models (and ResNet-50 for the plan CLI)
- :mod:`tests.support.data`: seeded batches and the loss step the PS tests train with
- :mod:`tests.support.training`: optimizers and single-process references to compare with
- :mod:`tests.support.clusters`: parameter servers and workers in this loop, ``tensorx ps``
  as a process, threads per rank, the examples as processes
- :mod:`tests.support.ucx_owner`: the UCX lane's owner process (below the Node, so not
  :class:`tensorx.testing.OwnerProcess`)
- :mod:`tests.support.sparse_rows`: staged sparse rows and an endpoint that copies them
- :mod:`tests.support.flat_update`: elementwise optimizers stepped on a shard's arena
- :mod:`tests.support.pipeline_models`, :mod:`tests.support.pipeline_worker`: the models of
  the pipeline tests and the stage process they start (``python -m``)
"""
