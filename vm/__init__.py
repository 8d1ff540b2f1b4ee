"""`make vm-test`: the kernel-dependent tests in VMs on Debian kernels (docs/vm-tests.md)."""
