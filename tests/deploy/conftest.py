"""Deploy tier: the Dockerfile and the Helm chart, checked offline (hadolint, helm lint and template,
kubernetes-validate against the Kubernetes schemas)."""
