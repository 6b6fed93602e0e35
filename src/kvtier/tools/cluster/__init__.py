"""`kvtier up`: a local fleet — N vLLM replicas with the kvtier connector, a shared L2 and the
router — described by one YAML file (`spec`), started and stopped as one unit (`run`)."""
