"""Feature extraction and the weighted kNN classifier (Wu et al. 2018, as in the MoCo/SCE monitors)."""
import torch
import torch.nn.functional as F


@torch.no_grad()
def extract_features(trunk, loader, device, channels_last=False, normalize=True):
    """Trunk features (l2-normalised unless normalize=False) and labels of a whole loader, in
    its order, with the trunk in eval mode."""
    was_training = trunk.training
    trunk.eval()
    feats, labels = [], []
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.to(memory_format=torch.channels_last)
        out = trunk(images).float()
        feats.append((F.normalize(out, dim=1) if normalize else out).cpu())
        labels.append(torch.as_tensor(targets))
    trunk.train(was_training)
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def knn_scores(train_feats, train_labels, test_feats, num_classes, k=200, t=0.07, chunk=1024):
    """Class scores: each of the k nearest train features (cosine) votes exp(cos / t) for its label."""
    k = min(k, len(train_feats))
    scores = []
    for q in test_feats.split(chunk):
        sim, idx = (q @ train_feats.T).topk(k, dim=1)
        votes = torch.zeros(len(q), num_classes, dtype=sim.dtype)
        votes.scatter_add_(1, train_labels[idx], (sim / t).exp())
        scores.append(votes)
    return torch.cat(scores)


def topk_accuracy(scores, labels, ks=(1, 5)):
    """Percent of rows whose label is among the top-k scores, for each k."""
    top = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    hit = top == labels.view(-1, 1)
    return [100.0 * hit[:, :k].any(dim=1).float().mean().item() for k in ks]


def knn_accuracy(trunk, train_loader, val_loader, num_classes, device, k=200, t=0.07):
    """(top-1, top-5) of the kNN classifier built on train_loader, measured on val_loader."""
    train_feats, train_labels = extract_features(trunk, train_loader, device)
    val_feats, val_labels = extract_features(trunk, val_loader, device)
    scores = knn_scores(train_feats, train_labels, val_feats, num_classes, k, t)
    return topk_accuracy(scores, val_labels)
