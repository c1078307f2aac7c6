// The Gateway API, pinned, for its CRDs only (the tests install HTTPRoute's): nothing is built
// from it.
module ladle.local/hack/k8s/gateway-api

go 1.26.0

require sigs.k8s.io/gateway-api v1.6.3
