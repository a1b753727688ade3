package workloads

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"

	"github.com/identityd/identityd/labels"
)

// LabelFilter splits labels into identity labels and information labels
// with Cilium's rules. Each prefix matches labels of its source (any, when
// it names none) whose key starts with it; a prefix of the default list or
// of --labels is a regular expression that must match at the key's start,
// a prefix of a label prefix file is plain text. A label is an identity
// label when the longest include that matches it is longer than the
// shortest ignore that matches it, or, when the filter has no include of
// its own (only the default list, or only ignores), when no ignore matches
// it. A match of length zero counts as none, as in Cilium.
type LabelFilter struct {
	prefixes []labelPrefix
	// allowList: an include was configured (file or --labels), so a label
	// no include matches is left out.
	allowList bool
}

type labelPrefix struct {
	source string
	prefix string
	ignore bool
	expr   *regexp.Regexp // nil: plain prefix
}

// match returns whether p matches l and over how many bytes of its key.
func (p labelPrefix) match(l labels.Label) (bool, int) {
	if p.source != "" && p.source != l.Source {
		return false, 0
	}
	if p.expr == nil {
		return strings.HasPrefix(l.Key, p.prefix), len(p.prefix)
	}
	loc := p.expr.FindStringIndex(l.Key)
	if loc == nil || loc[0] != 0 {
		return false, 0
	}
	return true, loc[1]
}

// defaultPrefixes is Cilium v1.16's default list: reserved labels, the
// namespace's name and labels, app.kubernetes.io and the cluster in; the
// rest of Kubernetes' own labels and the labels of controllers that differ
// from pod to pod (hashes, generations, indexes, job UIDs) out.
var defaultPrefixes = []string{
	labels.SourceReserved + ":.*",
	regexp.QuoteMeta(PodNamespaceLabel),
	regexp.QuoteMeta(strings.TrimSuffix(NamespaceLabelsPrefix, ".")),
	regexp.QuoteMeta("app.kubernetes.io"),
	regexp.QuoteMeta(ClusterLabel),
	`!io\.kubernetes`,
	`!kubernetes\.io`,
	"!" + regexp.QuoteMeta("statefulset.kubernetes.io/pod-name"),
	"!" + regexp.QuoteMeta("apps.kubernetes.io/pod-index"),
	"!" + regexp.QuoteMeta("batch.kubernetes.io/job-completion-index"),
	"!" + regexp.QuoteMeta("batch.kubernetes.io/controller-uid"),
	`!.*beta\.kubernetes\.io`,
	`!k8s\.io`,
	`!pod-template-generation`,
	`!pod-template-hash`,
	`!controller-revision-hash`,
	`!controller-uid`,
	`!annotation.*`,
	`!etcd_node`,
}

// labelPrefixFileVersion is the only version of a label prefix file.
const labelPrefixFileVersion = 1

// ErrLabelPrefix: a label prefix (of --labels or of a label prefix file)
// that Cilium would refuse.
var ErrLabelPrefix = errors.New("invalid label prefix")

// NewLabelFilter returns the filter of Cilium's --label-prefix-file and
// --labels: the prefixes of prefixFile (Cilium's JSON file, {"version": 1,
// "valid-prefixes": [{"source": …, "prefix": …, "invert": bool}]}), or the
// default list when prefixFile is nil, then each of prefixes, written
// [source:][!]regexp ("k8s:app", "k8s:!team"; an empty one is skipped).
// An include among either makes the filter an allow list.
func NewLabelFilter(prefixFile io.Reader, prefixes []string) (*LabelFilter, error) {
	f := &LabelFilter{}
	if prefixFile == nil {
		for _, s := range defaultPrefixes {
			p, err := parseLabelPrefix(s)
			if err != nil {
				return nil, err
			}
			f.prefixes = append(f.prefixes, p)
		}
	} else {
		var file struct {
			Version  int `json:"version"`
			Prefixes []struct {
				Ignore bool   `json:"invert"`
				Prefix string `json:"prefix"`
				Source string `json:"source"`
			} `json:"valid-prefixes"`
		}
		if err := json.NewDecoder(prefixFile).Decode(&file); err != nil {
			return nil, fmt.Errorf("label prefix file: %w", err)
		}
		if file.Version != labelPrefixFileVersion {
			return nil, fmt.Errorf("label prefix file: unsupported version %d, want %d", file.Version, labelPrefixFileVersion)
		}
		for i, p := range file.Prefixes {
			switch {
			case p.Prefix == "":
				return nil, fmt.Errorf("label prefix file: entry %d: %w: empty prefix", i, ErrLabelPrefix)
			case p.Source == "":
				return nil, fmt.Errorf("label prefix file: entry %d: %w: empty source", i, ErrLabelPrefix)
			}
			f.prefixes = append(f.prefixes, labelPrefix{source: p.Source, prefix: p.Prefix, ignore: p.Ignore})
			f.allowList = f.allowList || !p.Ignore
		}
	}
	for _, s := range prefixes {
		if s == "" {
			continue
		}
		p, err := parseLabelPrefix(s)
		if err != nil {
			return nil, err
		}
		f.prefixes = append(f.prefixes, p)
		f.allowList = f.allowList || !p.ignore
	}
	return f, nil
}

// parseLabelPrefix reads [source:][!]regexp.
func parseLabelPrefix(s string) (labelPrefix, error) {
	var p labelPrefix
	p.prefix = s
	if i := strings.IndexByte(s, ':'); i >= 0 {
		p.source, p.prefix = s[:i], s[i+1:]
	}
	if p.prefix == "" {
		return p, fmt.Errorf("%w %q: empty prefix", ErrLabelPrefix, s)
	}
	if p.prefix[0] == '!' {
		p.ignore, p.prefix = true, p.prefix[1:]
	}
	expr, err := regexp.Compile(p.prefix)
	if err != nil {
		return p, fmt.Errorf("%w %q: %w", ErrLabelPrefix, s, err)
	}
	p.expr = expr
	return p, nil
}

// Filter splits ls into its identity labels and its information labels,
// both sorted as ls is.
func (f *LabelFilter) Filter(ls labels.Labels) (identity, info labels.Labels) {
	identity, info = labels.Labels{}, labels.Labels{}
	for _, l := range ls {
		if f.keeps(l) {
			identity = append(identity, l)
		} else {
			info = append(info, l)
		}
	}
	return identity, info
}

// keeps is the rule of LabelFilter's doc.
func (f *LabelFilter) keeps(l labels.Label) bool {
	included, ignored := 0, 0
	for _, p := range f.prefixes {
		ok, n := p.match(l)
		switch {
		case !ok:
		case p.ignore:
			if ignored == 0 || n < ignored {
				ignored = n
			}
		case n > included:
			included = n
		}
	}
	return (!f.allowList && ignored == 0) || included > ignored
}
