.PHONY: demo test test-quick setup
demo:   ## set up .venv and run the main job (kvstream replay on the built-in workload)
	bash scripts/demo.sh
test:   ## set up .venv with test dependencies and run the whole test suite
	bash scripts/test.sh
test-quick:  ## the tests not marked slow (no LMCache-pins rerun): a few minutes
	bash scripts/test.sh --quick
setup:
	bash scripts/setup.sh test
