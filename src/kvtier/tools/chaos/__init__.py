"""Fault injection for `kvtier bench chaos`: a faulty FUSE layer, the fleet under test, its
load, the faults and their report (docs/reliability.md)."""
