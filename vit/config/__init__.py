"""What a run is asked to do, checked before any process group starts: the typed settings and the
command line, the DeepSpeed JSON and its schema, the engine x feature rules, and the plan."""
