"""Deploy tier: the Dockerfile and the Helm chart, checked offline (hadolint, helm lint and template,
kubernetes-validate against the Kubernetes schemas), and the scripts a clone runs first (scripts/setup.sh,
scripts/test.sh) on stand-ins for their slow parts; in the image tier (scripts/tiers/image.sh), the built image
(test_image.py)."""
