.PHONY: demo test setup
demo:   ## set up .venv and run the main job (kvstream replay on the built-in workload)
	bash scripts/demo.sh
test:   ## set up .venv with test dependencies and run the whole test suite
	bash scripts/test.sh
setup:
	bash scripts/setup.sh test
