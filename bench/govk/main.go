// govk is the Go reference for bench/exec_portforward.py: one virtual-kubelet node built with
// the virtual-kubelet module's node/nodeutil package, serving its kubelet API over TLS.
//
// The provider is our own and deliberately minimal. VK's mock provider makes exec and
// port-forward no-ops, which would measure nothing, so here exec runs the command on this
// machine with os/exec and port-forward dials 127.0.0.1:<port> and copies both ways, the same
// work vkubelet's mock provider does. Pods "run" in memory and are Running at once.
//
// Benchmark tooling, not product code.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vkslog "github.com/virtual-kubelet/virtual-kubelet/log/slog"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apiserver/pkg/server/dynamiccertificates"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	utilexec "k8s.io/utils/exec"
)

func main() {
	var (
		kubeconfig = flag.String("kubeconfig", "", "kubeconfig of the cluster")
		nodeName   = flag.String("nodename", "govk", "name of the virtual node")
		address    = flag.String("address", "127.0.0.1", "the node's InternalIP; the kubelet API listens on it")
		port       = flag.Int("port", 10250, "kubelet API port")
		certFile   = flag.String("tls-cert-file", "", "serving certificate (PEM)")
		keyFile    = flag.String("tls-private-key-file", "", "serving key (PEM)")
		clientCA   = flag.String("client-ca-file", "", "CA of the apiserver's kubelet client certificate")
		logLevel   = flag.String("log-level", "info", "debug, info, warn or error")
		version    = flag.Bool("version", false, "print versions and exit")
		qps        = flag.Float64("kube-api-qps", 100, "client QPS limit (negative: none)")
		burst      = flag.Int("kube-api-burst", 200, "client burst")
		workers    = flag.Int("workers", runtime.NumCPU(), "pod controller workers per queue (nodeutil's default)")
		queueLimit = flag.Bool("queue-rate-limit", true, "client-go's default queue limiter (global 10/s, burst 100); false: per-item back-off only")
		pods       = flag.String("pods", "110", "the node's pod capacity")
	)
	flag.Parse()
	if *version {
		fmt.Println(moduleVersion(), runtime.Version())
		return
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		stdlog.Fatal(err)
	}
	vklog.L = vkslog.FromSlog(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
	lim := limits{qps: *qps, burst: *burst, workers: *workers, globalQueue: *queueLimit, pods: *pods}
	if err := run(*kubeconfig, *nodeName, *address, *port, *certFile, *keyFile, *clientCA, lim); err != nil {
		stdlog.Fatal(err)
	}
}

// limits are the throttles under test: the client's QPS and burst (qps < 0: no client-side
// limit), the pod controller's workers per queue, and whether its queues keep client-go's default
// limiter (per-item back-off and a global 10/s, burst 100 bucket) or only the per-item back-off.
type limits struct {
	qps         float64
	burst       int
	workers     int
	globalQueue bool
	pods        string
}

func run(kubeconfig, nodeName, address string, port int, certFile, keyFile, clientCA string, lim limits) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	restConfig.QPS, restConfig.Burst = float32(lim.qps), lim.burst
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}

	// Authenticate the apiserver by its client certificate (signed by clientCA) or a bearer
	// token (TokenReview); authorize with SubjectAccessReviews on nodes/<name>/proxy.
	caProvider, err := dynamiccertificates.NewDynamicCAContentFromFile("client-ca", clientCA)
	if err != nil {
		return err
	}
	auth, err := nodeutil.WebhookAuth(client, nodeName, func(c *nodeutil.WebhookAuthConfig) error {
		c.AuthnConfig.ClientCertificateCAContentProvider = caProvider
		return nil
	})
	if err != nil {
		return err
	}
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	for _, apply := range []func(*tls.Config) error{
		nodeutil.WithKeyPairFromPath(certFile, keyFile), nodeutil.WithCAFromPath(clientCA),
	} {
		if err := apply(tlsConfig); err != nil {
			return err
		}
	}

	// What nodeutil.NewNode and Node.Run do, written out because NewNode gives no way to set the
	// pod controller's queue rate limiters (they are fields of node.PodControllerConfig only).
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, time.Minute, nodeutil.PodInformerFilter(nodeName))
	objectFactory := informers.NewSharedInformerFactoryWithOptions(client, time.Minute)
	podInformer := podFactory.Core().V1().Pods()
	p := newProvider()
	spec := nodeSpec(nodeName, address, port, lim.pods)

	mux := http.NewServeMux()
	pods := podInformer.Lister()
	mux.Handle("/", api.PodHandler(api.PodHandlerConfig{ // as nodeutil.AttachProviderRoutes
		RunInContainer:    p.RunInContainer,
		AttachToContainer: p.AttachToContainer,
		GetContainerLogs:  p.GetContainerLogs,
		GetPods:           p.GetPods,
		GetPodsFromKubernetes: func(context.Context) ([]*corev1.Pod, error) {
			return pods.List(labels.Everything())
		},
		GetStatsSummary:    p.GetStatsSummary,
		GetMetricsResource: p.GetMetricsResource,
		PortForward:        p.PortForward,
	}, true))
	listener, err := tls.Listen("tcp", net.JoinHostPort(address, strconv.Itoa(port)), tlsConfig)
	if err != nil {
		return err
	}
	server := &http.Server{Handler: nodeutil.WithAuth(auth, mux), ReadHeaderTimeout: 30 * time.Second}
	go server.Serve(listener) //nolint:errcheck
	defer server.Close()

	broadcaster := record.NewBroadcaster()
	broadcaster.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.CoreV1().Events(corev1.NamespaceAll)})
	defer broadcaster.Shutdown()
	recorder := broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: nodeName + "/pod-controller"})

	newLimiter := func() workqueue.TypedRateLimiter[any] {
		if lim.globalQueue {
			return workqueue.DefaultTypedControllerRateLimiter[any]()
		}
		return workqueue.NewTypedItemExponentialFailureRateLimiter[any](5*time.Millisecond, 1000*time.Second)
	}
	pc, err := node.NewPodController(node.PodControllerConfig{
		PodClient:                            client.CoreV1(),
		EventRecorder:                        recorder,
		Provider:                             p,
		PodInformer:                          podInformer,
		SecretInformer:                       objectFactory.Core().V1().Secrets(),
		ConfigMapInformer:                    objectFactory.Core().V1().ConfigMaps(),
		ServiceInformer:                      objectFactory.Core().V1().Services(),
		SyncPodsFromKubernetesRateLimiter:    newLimiter(),
		DeletePodsFromKubernetesRateLimiter:  newLimiter(),
		SyncPodStatusFromProviderRateLimiter: newLimiter(),
	})
	if err != nil {
		return err
	}
	naive := node.NewNaiveNodeProvider()
	nc, err := node.NewNodeController(naive, spec, client.CoreV1().Nodes(),
		node.WithNodeEnableLeaseV1(nodeutil.NodeLeaseV1Client(client), node.DefaultLeaseDuration))
	if err != nil {
		return err
	}

	go podFactory.Start(ctx.Done())
	go objectFactory.Start(ctx.Done())
	go pc.Run(ctx, lim.workers) //nolint:errcheck
	select {
	case <-ctx.Done():
		return nil
	case <-pc.Ready():
	case <-pc.Done():
		return pc.Err()
	}
	go nc.Run(ctx) //nolint:errcheck
	select {
	case <-ctx.Done():
		return nil
	case <-nc.Ready():
	case <-nc.Done():
		return nc.Err()
	}
	setNodeReady(spec)
	if err := naive.UpdateStatus(ctx, spec); err != nil {
		return err
	}
	vklog.G(ctx).Infof("node %s ready, kubelet API on %s:%d", nodeName, address, port)
	select {
	case <-ctx.Done():
	case <-nc.Done():
	case <-pc.Done():
	}
	return nil
}

// setNodeReady is nodeutil's: Ready with the kubelet's reason, phase Running.
func setNodeReady(n *corev1.Node) {
	n.Status.Phase = corev1.NodeRunning
	for i, c := range n.Status.Conditions {
		if c.Type != corev1.NodeReady {
			continue
		}
		c.Message = "Kubelet is ready"
		c.Reason = "KubeletReady"
		c.Status = corev1.ConditionTrue
		c.LastHeartbeatTime = metav1.Now()
		c.LastTransitionTime = metav1.Now()
		n.Status.Conditions[i] = c
		return
	}
}

// nodeSpec is the Node as nodeutil.NewNode starts it, plus what the scheduler and the apiserver
// need to know about this one.
func nodeSpec(name, address string, port int, pods string) *corev1.Node {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{
				"type":                   "virtual-kubelet",
				"kubernetes.io/role":     "agent",
				"kubernetes.io/hostname": name,
			},
		},
		Status: corev1.NodeStatus{
			Phase: corev1.NodePending,
			Conditions: []corev1.NodeCondition{
				{Type: corev1.NodeReady},
				{Type: corev1.NodeDiskPressure},
				{Type: corev1.NodeMemoryPressure},
				{Type: corev1.NodePIDPressure},
				{Type: corev1.NodeNetworkUnavailable},
			},
		},
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("1000"),
		corev1.ResourceMemory: resource.MustParse("4Ti"),
		corev1.ResourcePods:   resource.MustParse(pods),
	}
	n.Spec.Taints = []corev1.Taint{{
		Key: "virtual-kubelet.io/provider", Value: "govk", Effect: corev1.TaintEffectNoSchedule,
	}}
	n.Status.Capacity = capacity
	n.Status.Allocatable = capacity
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: address}}
	n.Status.DaemonEndpoints.KubeletEndpoint.Port = int32(port)
	n.Status.NodeInfo.OperatingSystem = "linux"
	n.Status.NodeInfo.Architecture = runtime.GOARCH
	n.Status.NodeInfo.KubeletVersion = moduleVersion()
	return n
}

// moduleVersion is the virtual-kubelet module version this binary was built with.
func moduleVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/virtual-kubelet/virtual-kubelet" {
				return "virtual-kubelet/" + dep.Version
			}
		}
	}
	return "virtual-kubelet/unknown"
}

// provider keeps pods in memory; every pod is Running as soon as it is created.
type provider struct {
	mu     sync.Mutex
	pods   map[string]*corev1.Pod
	notify func(*corev1.Pod)
}

func newProvider() *provider {
	return &provider{pods: map[string]*corev1.Pod{}, notify: func(*corev1.Pod) {}}
}

func key(namespace, name string) string { return namespace + "/" + name }

// NotifyPods makes this an asynchronous provider: status changes are pushed, not polled.
func (p *provider) NotifyPods(_ context.Context, notify func(*corev1.Pod)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = notify
}

func (p *provider) CreatePod(_ context.Context, pod *corev1.Pod) error {
	now := metav1.Now()
	pod = pod.DeepCopy()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.StartTime = &now
	pod.Status.PodIP = "127.0.0.1"
	pod.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
	}
	pod.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: new(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
	p.store(pod)
	return nil
}

func (p *provider) UpdatePod(_ context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, ok := p.pods[key(pod.Namespace, pod.Name)]; ok {
		updated := pod.DeepCopy()
		updated.Status = old.Status
		p.pods[key(pod.Namespace, pod.Name)] = updated
	}
	return nil
}

func (p *provider) DeletePod(_ context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	stored, ok := p.pods[key(pod.Namespace, pod.Name)]
	delete(p.pods, key(pod.Namespace, pod.Name))
	notify := p.notify
	p.mu.Unlock()
	if !ok {
		return nil
	}
	now := metav1.Now()
	stored.Status.Phase = corev1.PodSucceeded
	for i := range stored.Status.ContainerStatuses {
		status := &stored.Status.ContainerStatuses[i]
		status.Ready = false
		status.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
			Reason: "Completed", FinishedAt: now,
		}}
	}
	go notify(stored)
	return nil
}

func (p *provider) store(pod *corev1.Pod) {
	p.mu.Lock()
	p.pods[key(pod.Namespace, pod.Name)] = pod
	notify := p.notify
	p.mu.Unlock()
	go notify(pod.DeepCopy())
}

func (p *provider) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pod, ok := p.pods[key(namespace, name)]; ok {
		return pod.DeepCopy(), nil
	}
	return nil, nil
}

func (p *provider) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, _ := p.GetPod(ctx, namespace, name)
	if pod == nil {
		return nil, nil
	}
	return &pod.Status, nil
}

func (p *provider) GetPods(context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pods := make([]*corev1.Pod, 0, len(p.pods))
	for _, pod := range p.pods {
		pods = append(pods, pod.DeepCopy())
	}
	return pods, nil
}

func (p *provider) running(namespace, name string) error {
	if pod, _ := p.GetPod(context.Background(), namespace, name); pod == nil {
		return fmt.Errorf("pod %s/%s is not running here", namespace, name)
	}
	return nil
}

// RunInContainer runs the command on this machine, wired to the exec streams.
func (p *provider) RunInContainer(ctx context.Context, namespace, name, _ string, cmd []string, attach api.AttachIO) error {
	if err := p.running(namespace, name); err != nil {
		return err
	}
	if len(cmd) == 0 {
		return errors.New("no command")
	}
	command := exec.CommandContext(ctx, cmd[0], cmd[1:]...)
	if in := attach.Stdin(); in != nil {
		command.Stdin = in
	}
	if out := attach.Stdout(); out != nil {
		command.Stdout = out
	}
	if errOut := attach.Stderr(); errOut != nil {
		command.Stderr = errOut
	}
	err := command.Run()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		// The kubelet streaming code reports utilexec.ExitError codes to kubectl.
		return utilexec.CodeExitError{Err: err, Code: exitErr.ExitCode()}
	}
	return err
}

// PortForward dials the port on 127.0.0.1 (the pods "are" this machine) and copies both ways
// until the local server closes its side.
func (p *provider) PortForward(ctx context.Context, namespace, name string, port int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	if err := p.running(namespace, name); err != nil {
		return err
	}
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	if err != nil {
		return err
	}
	defer conn.Close()
	go func() {
		_, _ = io.Copy(conn, stream)
		_ = conn.(*net.TCPConn).CloseWrite()
	}()
	downstream := make(chan error, 1)
	go func() {
		_, err := io.Copy(stream, conn)
		downstream <- err
	}()
	select {
	case err = <-downstream:
		return err
	case <-ctx.Done():
		return nil
	}
}

// The rest of nodeutil.Provider is not benchmarked.

func (p *provider) GetContainerLogs(context.Context, string, string, string, api.ContainerLogOpts) (io.ReadCloser, error) {
	return nil, errors.ErrUnsupported
}

func (p *provider) AttachToContainer(context.Context, string, string, string, api.AttachIO) error {
	return errors.ErrUnsupported
}

func (p *provider) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return nil, errors.ErrUnsupported
}

func (p *provider) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, errors.ErrUnsupported
}
