"""STUB (vmbackup's branch): the VirtualMachine controller package; vmcrd's `__init__.py`
replaces this one at the merge."""
