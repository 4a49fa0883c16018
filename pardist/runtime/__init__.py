"""The bottom layer: the process group, meshes, the step context, trees, failures.

Holds who this process is (``_process``), named meshes over DeviceMesh, the running
step's context, pytree helpers, gradient layouts, seeding, logging and pardist's
warnings and errors. Imports nothing else of pardist. Public names are re-exported
by ``pardist``.
"""
