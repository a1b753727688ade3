package k8stest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"k8s.io/client-go/rest"
)

// GetRaw GETs path (such as "/readyz" or "/apis") from the API server cfg
// names, with cfg's credentials, and returns the body of a 200 answer.
// It is for the paths that no typed client serves; reading them through
// client-go's discovery would compile the scheme of every built-in API
// group into the test.
func GetRaw(ctx context.Context, cfg *rest.Config, path string) ([]byte, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(cfg.Host, "/")+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %.500s", path, resp.Status, body)
	}
	return body, nil
}

// GetJSON GETs path as GetRaw does and decodes the JSON answer into into.
func GetJSON(ctx context.Context, cfg *rest.Config, path string, into any) error {
	body, err := GetRaw(ctx, cfg, path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(body, into); err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	return nil
}
