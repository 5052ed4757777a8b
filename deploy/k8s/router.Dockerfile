# The image of smg.yaml's router: cbserve's image plus smg, the Shepherd model gateway (PyPI `smg`).
#
#   docker build -t cbserve .                                              # first, at the repository root
#   docker build -t cbserve-router -f deploy/k8s/router.Dockerfile deploy/k8s
#
# Built on cbserve's image for two reasons: smg tokenizes requests itself and needs the model's
# tokenizer, which that image carries (the converted default model under $CBSERVE_HOME), and the nodes
# already hold its layers for the cbserve pods, so only smg's own layer is new to them.
ARG CBSERVE_IMAGE=cbserve:latest
# hadolint ignore=DL3006
FROM ${CBSERVE_IMAGE}

# The version `pip install 'cbserve[router]'` installs (pyproject.toml), so that the flags in smg.yaml
# are the ones tests/test_k8s_manifests.py checks against.
ARG SMG_SPEC="smg==1.13.0"
# The virtual environment belongs to root; run as the image's unprivileged user again afterwards.
USER 0
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "$SMG_SPEC" && smg --version
USER 10001:10001

ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
