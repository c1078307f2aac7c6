// kstatus-compute prints what sigs.k8s.io/cli-utils' kstatus library (the status Flux, kpt and
// `kubectl wait`-style tools compute) says about each object in a JSON array read from stdin:
// one JSON array of {"status", "message"} on stdout, in the same order.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	// apimachinery's decoder keeps whole numbers as int64, as the API server's objects have them.
	var objects []map[string]interface{}
	data, err := io.ReadAll(os.Stdin)
	if err == nil {
		err = utiljson.Unmarshal(data, &objects)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kstatus-compute: stdin is not a JSON array of objects: %v\n", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(objects))
	for i, obj := range objects {
		res, err := status.Compute(&unstructured.Unstructured{Object: obj})
		if err != nil {
			fmt.Fprintf(os.Stderr, "kstatus-compute: object %d: %v\n", i, err)
			os.Exit(1)
		}
		out = append(out, result{Status: res.Status.String(), Message: res.Message})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "kstatus-compute: %v\n", err)
		os.Exit(1)
	}
}
